"""The Qwen2 / Qwen3 decoder forward in fp32, built from row-invariant pieces only.

Rows of every stream in a forward are concatenated: linear layers, norms and activations treat each row on
its own, attention reads each stream's keys from the cache, so no row's bits depend on which other rows
share the forward. The kernels come from a backend (kernels.backend: torch on the CPU, Triton on a GPU);
everything else here is elementwise or indexing, which is row-invariant on either device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Callable

import torch

from tfq.kernels.attention import AttentionBatch, attend_fixed, write
from tfq.kernels.backend import Backend, LinearFn, torch_backend
from tfq.kernels.layer import fusable
from tfq.kernels.quant import Quantized, join
from tfq.kernels.rowwise import rms_norm_fixed
from tfq.proofs.startup_kernels import check_layers, ensure_exact
from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.model.rope import rope_tables


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split (neox) layout as in HF Qwen. x [N, heads, D]; cos [N, 1, D]; sin [N, 1, D]
    with its first half negated, so that x * cos + roll(x) * sin is HF's x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


Tap = Callable[[str, torch.Tensor], torch.Tensor]  # (op name, its output) -> the output, unchanged


def untapped(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: LinearFn
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn
    down: LinearFn


class Qwen:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: Backend | None = None):
        self.backend = backend = backend or torch_backend()
        ensure_exact(backend)
        self.config = config
        c = config
        take = _Taker(weights, c.family, backend.device)

        def Linear(w, b=None):  # fp32 weights, or a GGUF's blocks (kept by load_model for weights: gguf)
            return backend.quant_linear(w, b) if isinstance(w, Quantized) else backend.linear(w, b)

        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers: list[Layer] = []
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_w = stack([take(a + "q_proj.weight", (q_out, c.hidden_size)),
                               take(a + "k_proj.weight", (kv_out, c.hidden_size)),
                               take(a + "v_proj.weight", (kv_out, c.hidden_size))])
            qkv_b = None
            if c.qkv_bias:
                qkv_b = torch.cat([take(a + "q_proj.bias", (q_out,)), take(a + "k_proj.bias", (kv_out,)),
                                   take(a + "v_proj.bias", (kv_out,))])
            m = p + "mlp."
            gate_up = stack([take(m + "gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                                 take(m + "up_proj.weight", (c.intermediate_size, c.hidden_size))])
            self.layers.append(Layer(
                input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
                qkv=Linear(qkv_w, qkv_b),
                q_norm=take(a + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                k_norm=take(a + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                o=Linear(take(a + "o_proj.weight", (c.hidden_size, q_out))),
                post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                gate_up=Linear(gate_up),
                down=Linear(take(m + "down_proj.weight", (c.hidden_size, c.intermediate_size))),
            ))
        self.norm = take("model.norm.weight", (c.hidden_size,))
        head = self.embed if c.tie_embeddings else take("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = Linear(head)
        self._rope_rows = 0
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.act = backend.silu  # the MLP's activation; the guard's tests swap in flawed ones and must see them
        self.layer_clock: torch.Tensor | None = None  # float64 [2]: tfq bench's breakdown reads the one-call layer
        self.proved: dict = {}  # what the start-up guard proved on this model (tfq.proofs.startup), by its settings
        first = self.layers[0]
        check_layers({"qkv": first.qkv, "o": first.o, "gate_up": first.gate_up, "down": first.down,
                      "lm_head": self.lm_head}, backend)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if need > self._rope_rows:  # one table for every position: a row's angles never depend on the batch
            rows = max(need, 2 * self._rope_rows, 4096)
            cos, sin = rope_tables(self.config, rows)  # the attention factor applied after cos/sin, as HF does
            sin[:, : sin.shape[1] // 2].neg_()
            # computed on the CPU on every backend, so both see the same angles
            dev = self.backend.device
            self._cos, self._sin, self._rope_rows = cos.to(dev), sin.to(dev), rows
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, cache_rows: torch.Tensor,
                batch: AttentionBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """ids, positions, cache_rows: [N] (cache_rows: where each row's key and value are stored).
        Returns fp32 logits [len(logit_rows), vocab] on the CPU (where sampling and digests run)."""
        dev = self.backend.device
        ids, positions, logit_rows = ids.to(dev), positions.to(dev), logit_rows.to(dev)
        cos, sin = self._rope(positions)
        x = self.embedding(ids)
        for i, layer in enumerate(self.layers):
            x = self.decoder_layer(layer, x, cos, sin, cache, i, cache_rows, batch)
        return self.logits(x[logit_rows])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the embedding for `ids` (a quantized table gives each row its dequantized values)."""
        return self.embed.rows(ids) if isinstance(self.embed, Quantized) else self.embed[ids]

    def decoder_layer(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, index: int,
                      cache_rows: torch.Tensor, batch: AttentionBatch, tap: Tap = untapped) -> torch.Tensor:
        """One decoder layer over the forward's rows x [N, hidden]; its keys and values go to layer `index` of
        the cache. `tap` sees every op's output (the start-up guard compares them row by row). Untapped, on
        tfq's CPU kernels, the layer runs as one call (`one_call`): the same ops in the same order."""
        if tap is untapped and self.runs_in_one_call(layer):
            return self.one_call(layer, x, cos, sin, cache, index, cache_rows, batch)
        c = self.config
        n = x.shape[0]
        norm = self.backend.rms_norm
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = tap("input norm", norm(x, layer.input_norm, c.rms_eps))
        qkv = tap("qkv", layer.qkv(h))
        qk, v = qkv[:, :q_out + kv_out], qkv[:, q_out + kv_out:]  # views (slicing is cheaper than split)
        qk = qk.reshape(n, c.num_heads + c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            qk = tap("q/k norm", torch.cat([norm(qk[:, :c.num_heads], layer.q_norm, c.rms_eps),
                                            norm(qk[:, c.num_heads:], layer.k_norm, c.rms_eps)], 1))
        qk = tap("rotary", rotate(qk, cos, sin))  # queries and keys in one go
        q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        cache.write(index, cache_rows, k, v)  # cache first: new keys are read back like old ones
        if tap is not untapped:
            tap("cache store", cache.stored(index, cache_rows))
        a = tap("attention", self.backend.attend(q, cache.k[index], cache.v[index], batch, self.scale))
        x = tap("attention residual", x + tap("o", layer.o(a.reshape(n, q_out))))
        h = tap("post norm", norm(x, layer.post_norm, c.rms_eps))
        gate_up = tap("gate_up", layer.gate_up(h))
        gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
        mixed = tap("silu * up", tap("silu", self.act(gate)) * up)
        return tap("mlp residual", x + tap("down", layer.down(mixed)))

    def runs_in_one_call(self, layer: Layer) -> bool:
        """Whether the backend has a one-call layer and this layer is made of exactly what it runs (the guard's
        tests swap in flawed kernels, and a clock that wraps a linear layer sees it only op by op)."""
        b = self.backend
        return (b.layer is not None and self.act is b.silu and b.attend is attend_fixed and b.store is write
                and b.rms_norm is rms_norm_fixed and fusable(layer.qkv, layer.o, layer.gate_up, layer.down))

    def one_call(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, index: int,
                 cache_rows: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """decoder_layer in one call to the backend (kernels/layer.py)."""
        c = self.config
        return self.backend.layer(x, layer.input_norm, layer.qkv, layer.q_norm, layer.k_norm, cos, sin,
                                  cache.k[index], cache.v[index], cache_rows, cache.dtype_name, batch, self.scale,
                                  layer.o, layer.post_norm, layer.gate_up, layer.down, c.num_heads,
                                  c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_eps, self.layer_clock)

    def logits(self, x: torch.Tensor, tap: Tap = untapped) -> torch.Tensor:
        """The final norm and the head over the rows that draw; fp32 logits on the CPU."""
        h = tap("final norm", self.backend.rms_norm(x, self.norm, self.config.rms_eps))
        return tap("head", self.lm_head(h)).cpu()


def stack(parts: list) -> torch.Tensor | Quantized:
    """Matrices one under the other (q, k and v into one layer): quantized if all are, else fp32 (a quantized
    part dequantized: the same values)."""
    if all(isinstance(p, Quantized) for p in parts):
        return join(parts)
    return torch.cat([p.dequantized() if isinstance(p, Quantized) else p for p in parts])


class _Taker:
    """Pulls named tensors out of a state dict, checking shapes, so a wrong checkpoint fails in one line."""

    def __init__(self, weights: dict[str, torch.Tensor], family: str, device: torch.device):
        self.weights = weights
        self.family = family
        self.device = device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.weights.get(name)
        if t is None:
            raise TfqError(f"checkpoint has no tensor {name}; its weights do not match its config.json "
                           f"(a {self.family} model): re-export or re-convert the checkpoint")
        if tuple(t.shape) != shape:
            raise TfqError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, config says {shape}")
        if isinstance(t, Quantized):
            return t
        return t.float().contiguous().to(self.device)
