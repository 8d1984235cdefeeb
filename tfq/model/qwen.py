"""The Qwen2 / Qwen3 / Qwen3.5 decoder forward in fp32, built from row-invariant pieces only.

Rows of every stream in a forward are concatenated: linear layers, norms and activations treat each row on
its own, attention reads each stream's keys from the cache, so no row's bits depend on which other rows
share the forward. The kernels come from a backend (kernels.backend: torch on the CPU, Triton on a GPU);
everything else here is elementwise or indexing, which is row-invariant on either device.

A Qwen3.5 hybrid interleaves Gated DeltaNet layers (a recurrence with a fixed-size state per stream, kept in
the cache's state slots: tfq/engine/cache.py) with gated full attention layers (partial rotary, the output times
sigmoid of a gate that q_proj computes beside the queries). Its DeltaNet arithmetic is the recurrence for every
row (kernels/delta.py), so a row's bits do not depend on how its prompt was chunked.
"""
from __future__ import annotations

import contextlib
import math

import torch

from tfq.errors import TfqError
from tfq.heap import give_back
from tfq.kernels.attention import AttentionBatch, attend_fixed, write
from tfq.kernels.backend import Backend, LinearFn, torch_backend
from tfq.kernels.delta import (
    DeltaSizes,
    DeltaWeights,
    deltanet_chunks,
    deltanet_rows,
    gated_rms_norm,
    sigmoid_gate,
)
from tfq.kernels.layer import AttentionInputs, DeltaState, DrawFacts, LayerSizes, fusable
from tfq.kernels.quant import Quantized, Stacked
from tfq.kernels.rowwise import rms_norm_fixed
from tfq.model.config import ModelConfig
from tfq.model.kernel_guard import check_layers, ensure_exact
from tfq.model.layers import DeltaLayer, Layer
from tfq.model.mlp_weights import stack, take_mlp, take_moe
from tfq.model.moe import Fused, MoE, Tap, moe_mlp, untapped
from tfq.model.one_object import OneObject
from tfq.model.rope import rope_tables
from tfq.model.segments import Segment, Segments
from tfq.model.taker import Taker
from tfq.nearest import exp32


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split (neox) layout as in HF Qwen. x [N, heads, D]; cos [N, 1, D]; sin [N, 1, D]
    with its first half negated, so that x * cos + roll(x) * sin is HF's x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Qwen(OneObject):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: Backend | None = None,
                 shard=None):
        """shard: a tensor-parallel rank's share (tfq/parallel/shard.py; tfq/parallel/model.py runs it)."""
        self.backend = backend = backend or torch_backend()
        ensure_exact(backend)
        self.config = config
        c = config
        if c.hybrid and (backend.name != "torch" or backend.layer is None):
            raise TfqError(f"a {c.family} hybrid's DeltaNet layers run on tfq's CPU kernels (kernels/cpu/delta.cpp), "
                           f"which this run does not have ({backend.where}); use device: cpu with TFQ_CPU_KERNELS "
                           f"auto or tfq, and a C++ compiler")
        # Qwen3.5 stores norms as weight - 1 in transformers' layout; MLX's stores the weight itself (and the
        # convolution as [channels, taps, 1]), which its convolution's shape tells, as mlx-lm tells it
        taps = c.deltanet.conv_kernel if c.hybrid else None
        mlx_layout = c.hybrid and any(k.endswith("conv1d.weight") and weights[k].shape[-1] == 1 != taps
                                      for k in weights)
        offset = c.hybrid and not mlx_layout and not getattr(weights, "norms_multiply", False)
        take = Taker(weights, c.family, backend.device, offset=offset, shard=shard)

        Linear = self.make_linear

        norm = take.norm  # a Qwen3.5 norm multiplies by 1 + its stored weight: loaded as what it multiplies by
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        # the head before the layers: unpacking it (the largest matrix) then costs memory while little is kept
        head = take.kept("lm_head.weight", self.embed.quantized() if hasattr(self.embed, "quantized") else
                         self.embed) if c.tie_embeddings else take("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = Linear(head)
        del head
        self.layers: list[Layer | DeltaLayer] = []
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, kind in enumerate(c.kinds):
            give_back()  # the temporaries freed between the weights kept so far (tfq/heap.py)
            p = f"model.layers.{i}."
            m = p + "mlp."
            mlp = dict(input_norm=norm(p + "input_layernorm.weight", c.hidden_size), post_norm=norm(
                p + "post_attention_layernorm.weight", c.hidden_size), gate_up=None, down=None)
            if i in c.moe_layers:
                mlp["moe"] = take_moe(take, m, c, Linear)
            else:
                mlp.update(take_mlp(take, m, c.intermediate_size, c.hidden_size, Linear).__dict__)
            if kind == "linear_attention":
                self.layers.append(self._deltanet(take, p + "linear_attn.", Linear, mlp))
                continue
            a = p + "self_attn."
            q = take(a + "q_proj.weight", (q_out * (2 if c.hybrid else 1), c.hidden_size))
            gate = None
            if c.hybrid:  # each head's rows: its queries, then its gate; the gate goes after v (same sums)
                rows = torch.arange(q.shape[0]).reshape(-1, 2, c.head_dim)  # a tensor-parallel rank's heads only
                q, gate = (q.select(r.reshape(-1)) if isinstance(q, Quantized) else q[r.reshape(-1)]
                           for r in rows.unbind(1))
            qkv_w = stack([q, take(a + "k_proj.weight", (kv_out, c.hidden_size)),
                           take(a + "v_proj.weight", (kv_out, c.hidden_size))] + ([gate] if c.hybrid else []))
            qkv_b = None
            if c.qkv_bias:
                qkv_b = torch.cat([take(a + "q_proj.bias", (q_out,)), take(a + "k_proj.bias", (kv_out,)),
                                   take(a + "v_proj.bias", (kv_out,))])
            self.layers.append(Layer(
                qkv=Linear(qkv_w, qkv_b) if qkv_w.shape[0] else None,  # None: a rank without heads (tp)
                q_norm=norm(a + "q_norm.weight", c.head_dim) if c.qk_norm else None,
                k_norm=norm(a + "k_norm.weight", c.head_dim) if c.qk_norm else None,
                o=Linear(take(a + "o_proj.weight", (c.hidden_size, q_out))),
                gated=c.hybrid, **mlp,
            ))
        self.norm = norm("model.norm.weight", c.hidden_size)
        self._rope_rows = 0
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.act = backend.silu  # the MLP's activation; the guard's tests swap in flawed ones and must see them
        self.layer_clock: torch.Tensor | None = None  # float64 [3]: tfq bench's breakdown reads the one-call layer
        self.proved: dict = {}  # what the start-up guard proved on this model (tfq.engine.layer_guard), by its settings
        self.cache_index = c.cache_index  # layer -> its index among the cache's attention or state layers
        if shard is not None:  # what this rank computes with: its heads, its slice of the MLP
            self.config = shard.local_config()
        own = self.config  # what the one-call layers take besides a layer's weights
        self.layer_sizes = LayerSizes(own.num_heads, own.num_kv_heads, own.head_dim, own.intermediate_size,
                                      own.rms_eps, self.scale, own.moe.intermediate if own.moe_layers else 0,
                                      own.moe.shared_intermediate if own.moe_layers else 0)
        first = self.layers[c.attention_layers[0]] if c.attention_layers else self.layers[0]
        layers = {"lm_head": self.lm_head}
        dense = next((layer for layer in self.layers if layer.moe is None), None)
        if dense is not None:
            layers.update(gate_up=dense.gate_up, down=dense.down)
        if c.moe_layers:
            moe = self.layers[c.moe_layers[0]].moe
            layers.update(router=moe.router, expert_gate_up=moe.experts[0].gate_up, expert_down=moe.experts[0].down)
        if isinstance(first, Layer):
            layers.update(o=first.o, **({"qkv": first.qkv} if first.qkv is not None else {}))
        if c.deltanet_layers:
            delta = self.layers[c.deltanet_layers[0]]
            layers.update(out_proj=delta.out_proj, **({"in_proj": delta.in_proj} if delta.in_proj is not None else {}))
        give_back()  # the last layer's temporaries, before the check's outputs (a head's 64 rows: 39 MB)
        check_layers(layers, backend)
        self.stack = self.one_object()

    def make_linear(self, w, b=None) -> LinearFn:
        """A linear layer on fp32 weights, or on quantized ones kept by load_model (weights: gguf or mlx)."""
        if isinstance(w, (Quantized, Stacked)):
            return self.backend.quant_linear(w, b)
        return self.backend.linear(w, b)

    def _deltanet(self, take, a: str, Linear, mlp: dict) -> DeltaLayer:
        """One Gated DeltaNet layer's tensors, checked against the config's sizes."""
        c, n = self.config, self.config.deltanet
        v = n.value_heads * n.value_dim
        h = c.hidden_size
        in_proj = stack([take(a + "in_proj_qkv.weight", (n.channels, h)), take(a + "in_proj_z.weight", (v, h)),
                         take(a + "in_proj_b.weight", (n.value_heads, h)),
                         take(a + "in_proj_a.weight", (n.value_heads, h))])
        conv = take.conv(a + "conv1d.weight", n.channels, n.conv_kernel)
        # A = -exp(A_log) once, the exp rounded to the nearest float32 (tfq/nearest.py: the same bits on every
        # CPU, within an ulp of transformers' fp32 exp); a GGUF file stores A itself
        A = take(a + "A", (n.value_heads,)) if take.get(a + "A") is not None else \
            -torch.from_numpy(exp32(take(a + "A_log", (n.value_heads,)).numpy()))
        mixer = DeltaWeights(conv=conv[:, 0].T.contiguous(), A=A, dt_bias=take(a + "dt_bias", (n.value_heads,)),
                             norm=take(a + "norm.weight", (n.value_dim,)))
        return DeltaLayer(in_proj=Linear(in_proj) if in_proj.shape[0] else None, mixer=mixer,  # None: a rank without
                          out_proj=Linear(take(a + "out_proj.weight", (h, v))),  # DeltaNet heads (tp)
                          **mlp)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        one = positions.tolist()[0] if positions.shape[0] == 1 else None  # a decode row: views, not an index op
        need = (one if one is not None else int(positions.max())) + 1
        if need > self._rope_rows:  # one table for every position: a row's angles never depend on the batch
            rows = max(need, 2 * self._rope_rows, 4096)
            cos, sin = rope_tables(self.config, rows)  # the attention factor applied after cos/sin, as HF does
            sin[:, : sin.shape[1] // 2].neg_()
            # computed on the CPU on every backend, so both see the same angles
            dev = self.backend.device
            self._cos, self._sin, self._rope_rows = cos.to(dev), sin.to(dev), rows
        if one is not None:
            return self._cos[one:one + 1, None], self._sin[one:one + 1, None]
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, cache_rows: torch.Tensor,
                batch: AttentionBatch, logit_rows: torch.Tensor, segments: Segments | None = None,
                facts: DrawFacts | None = None) -> torch.Tensor:
        """ids, positions, cache_rows: [N] (cache_rows: where each row's key and value are stored); segments:
        each stream's rows for the DeltaNet layers, and their algorithm (tfq.engine.batch.step_rows). Returns fp32
        logits [len(logit_rows), vocab] on the CPU (where sampling and digests run). `facts` gains what a draw
        reads of each row where the one object runs the head (elsewhere it is left as it was)."""
        dev = self.backend.device
        if dev.type != "cpu":  # each .to costs microseconds even where it has nothing to do
            ids, positions, logit_rows = ids.to(dev), positions.to(dev), logit_rows.to(dev)
        cos, sin = self._rope(positions)
        x = self.embedding(ids)
        if self.runs_as_stack(segments, cache):
            handle = self.stack.handle  # with the head: it returns the logits rows' logits, on the CPU
            x = self.run_stack(handle, self.layers, x, self.stack_inputs(
                self.layers, self.cache_index, cache, (cos, sin), cache_rows, batch, segments), segments,
                logit_rows if handle.head else None, facts)
            if handle.head:
                return x
        else:
            for i, layer in enumerate(self.layers):
                x = self.decoder_layer(layer, x, cos, sin, cache, self.cache_index[i], cache_rows, batch,
                                       segments=segments)
        return self.logits(x.index_select(0, logit_rows))  # a plain gather: x[rows] parses an index first

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the embedding for `ids` (a quantized table gives each row its dequantized values)."""
        return self.embed[ids] if isinstance(self.embed, torch.Tensor) else self.embed.rows(ids)

    def decoder_layer(self, layer: Layer | DeltaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                      index: int, cache_rows: torch.Tensor, batch: AttentionBatch, tap: Tap = untapped,
                      segments: Segments | None = None) -> torch.Tensor:
        """One decoder layer over the forward's rows x [N, hidden]; its keys and values go to layer `index` of
        the cache (a DeltaNet layer's state to its state layer `index`, by `segments`). `tap` sees every op's
        output (the start-up guard compares them row by row). Untapped, on tfq's CPU kernels, the layer runs as
        one call (`one_call`): the same ops in the same order."""
        if tap is untapped and not (segments is not None and segments.chunked) and self.runs_in_one_call(layer):
            return self.one_call(layer, x, cos, sin, cache, index, cache_rows, batch, segments)
        if isinstance(layer, DeltaLayer):
            return self.deltanet_layer(layer, x, cache, index, segments, tap)
        c = self.config
        n = x.shape[0]
        norm = self.backend.rms_norm
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = tap("input norm", norm(x, layer.input_norm, c.rms_eps))
        if layer.qkv is None:  # a tensor-parallel rank holding no heads: only its share of o and the MLP
            return self.mlp(layer, x + self.joined("o", tap("o", layer.o(self.joined("heads", x[:, :0])))), tap,
                            segments)
        qkv = tap("qkv", layer.qkv(h))
        qk, v = qkv[:, :q_out + kv_out], qkv[:, q_out + kv_out:q_out + 2 * kv_out]  # views (cheaper than split)
        qk = qk.reshape(n, c.num_heads + c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            qk = tap("q/k norm", torch.cat([norm(qk[:, :c.num_heads], layer.q_norm, c.rms_eps),
                                            norm(qk[:, c.num_heads:], layer.k_norm, c.rms_eps)], 1))
        rd = cos.shape[-1]  # a hybrid turns only the first dimensions of each head (partial rotary)
        qk = tap("rotary", rotate(qk, cos, sin) if rd == c.head_dim else
                 torch.cat([rotate(qk[..., :rd], cos, sin), qk[..., rd:]], -1))  # queries and keys in one go
        q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        cache.write(index, cache_rows, k, v)  # cache first: new keys are read back like old ones
        if tap is not untapped:
            tap("cache store", cache.stored(index, cache_rows))
        a = tap("attention", self.backend.attend(q, cache.k[index], cache.v[index], batch, self.scale))
        a = a.reshape(n, q_out)
        if layer.gated:
            a = tap("output gate", sigmoid_gate(a, qkv[:, q_out + 2 * kv_out:]))
        x = tap("attention residual", x + self.joined("o", tap("o", layer.o(self.joined("heads", a)))))
        return self.mlp(layer, x, tap, segments)

    def joined(self, site: str, t: torch.Tensor) -> torch.Tensor:
        """What a layer needs whole at `site` (heads, values, o, mlp, down, head): one process has it all; a tensor-
        parallel rank gathers it (tfq/parallel/model.py)."""
        return t

    def on_its_own(self, proof: tuple = ()):
        """A context in which this process computes without its peers (the start-up guard's proofs): nothing to
        change in one process; a tensor-parallel rank stands its own columns in for the gathers, and rank 0 has
        the other ranks prove `proof` (prove's arguments) meanwhile. It yields the list their refusals land in."""
        return contextlib.nullcontext([])

    def mlp(self, layer: Layer | DeltaLayer, x: torch.Tensor, tap: Tap,
            segments: Segments | None = None) -> torch.Tensor:
        """The second half of every layer: post norm, gate_up, SiLU * up, down, residual (or the mixture of
        experts, tfq/model/moe.py)."""
        c, norm = self.config, self.backend.rms_norm
        h = tap("post norm", norm(x, layer.post_norm, c.rms_eps))
        if layer.moe is not None:
            return tap("mlp residual", x + self.mixture(layer.moe, h, tap, segments))
        gate_up = tap("gate_up", layer.gate_up(h))
        gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
        mixed = tap("silu * up", tap("silu", self.act(gate)) * up)
        return tap("mlp residual", x + self.joined("down", tap("down", layer.down(self.joined("mlp", mixed)))))

    def mixture(self, moe: MoE, h: torch.Tensor, tap: Tap, segments: Segments | None) -> torch.Tensor:
        """A mixture of experts on the post-norm rows h (tfq/model/moe.py): untapped, in the backend's two C++ calls
        where it has them (the start-up guard compares them with the tapped ops)."""
        by_load = segments is not None and segments.experts_by_load
        b = self.backend
        fused = Fused(b.moe_route, b.moe_mixture, self.config.moe.intermediate, self.layer_clock) \
            if b.moe_mixture is not None and self.act is b.silu and tap is untapped and not by_load else None
        return moe_mlp(moe, h, self.act, tap, by_load, fused)

    def deltanet_layer(self, layer: DeltaLayer, x: torch.Tensor, cache, index: int, segments: Segments,
                       tap: Tap = untapped) -> torch.Tensor:
        """A Gated DeltaNet layer: projections, the recurrence over each stream's rows from its state slot
        (updated in place), the gated norm, the output projection, then the MLP."""
        c, n = self.config, self.config.deltanet
        rows, v = x.shape[0], n.value_heads * n.value_dim
        h = tap("input norm", self.backend.rms_norm(x, layer.input_norm, c.rms_eps))
        if layer.in_proj is None:  # a tensor-parallel rank holding no DeltaNet head: its share of the rest only
            o = layer.out_proj(self.joined("values", x[:, :0]))
            return self.mlp(layer, x + self.joined("o", tap("out_proj", o)), tap, segments)
        mixed, z, b, a = self.projections(tap("in_proj", layer.in_proj(h)))
        state = cache.state
        if segments.chunked:
            o = deltanet_chunks(mixed, a, b, layer.mixer, state.conv[index], state.rec[index], segments.table,
                                self.sizes)
        else:
            if state.verify_rows:
                state.keep_inputs(index, segments, mixed, a, b)
            o = deltanet_rows(mixed, a, b, layer.mixer, state.conv[index], state.rec[index], segments.table, self.sizes,
                              state.saved_conv[index], state.saved_rec[index])
        tap("recurrence", o)
        if tap is not untapped:
            tap("recurrent state", state.fingerprint(index, segments, rows))
        o = tap("gated norm", gated_rms_norm(o.reshape(rows * n.value_heads, n.value_dim), layer.mixer.norm,
                                             z.reshape(rows * n.value_heads, n.value_dim), c.rms_eps).reshape(rows, v))
        x = tap("attention residual", x + self.joined("o", tap("out_proj", layer.out_proj(self.joined("values", o)))))
        return self.mlp(layer, x, tap, segments)

    def projections(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A DeltaNet layer's in_proj output split into its parts (views): the convolution's channels (q, k, v),
        z, b and a."""
        n = self.config.deltanet
        v = n.value_heads * n.value_dim
        return (proj[:, :n.channels], proj[:, n.channels:n.channels + v],
                proj[:, n.channels + v:n.channels + v + n.value_heads], proj[:, n.channels + v + n.value_heads:])

    def roll_back(self, cache, slot: int, rows: int) -> None:
        """A hybrid's DeltaNet states in `slot` as they were after the first `rows` rows of the verify that last
        ran there: restored from before the verify, then those rows run again from their kept inputs, by the
        same recurrence (the same bits: a row's arithmetic does not depend on the forward it is in)."""
        state = cache.state
        state.restore(slot)
        if self.config.deltanet.key_heads == 0:  # a tensor-parallel rank without DeltaNet heads keeps no state
            return
        segment = Segments.of([Segment(0, rows, slot, False, False)]).table
        for i in self.config.deltanet_layers:
            index = self.cache_index[i]
            x, a, b = (t[slot, :rows] for t in state.inputs[index])
            deltanet_rows(x, a, b, self.layers[i].mixer, state.conv[index], state.rec[index], segment, self.sizes)

    def copy_state(self, cache, source: int, target: int) -> None:
        """Slot `source`'s DeltaNet states into slot `target` (a hybrid drafter's checkpoint)."""
        cache.state.copy(source, target)

    @property
    def sizes(self) -> DeltaSizes:
        n = self.config.deltanet
        return DeltaSizes(n.conv_kernel, n.key_heads, n.key_dim, n.value_heads, n.value_dim)

    def runs_in_one_call(self, layer: Layer | DeltaLayer) -> bool:
        """Whether the backend has a one-call layer of this kind and the layer is made of exactly what it runs. A
        DeltaNet layer with a mixture (Qwen3.5 MoE) has none: it runs op by op, or in the model's one object."""
        return self.made_for_one_call(layer) and not (isinstance(layer, DeltaLayer) and layer.moe is not None)

    def made_for_one_call(self, layer: Layer | DeltaLayer) -> bool:
        """Whether the backend's kernels are the one-call layers' and the layer is made of what they run (the guard's
        tests swap in flawed kernels, and a clock that wraps a linear layer sees it only op by op)."""
        b = self.backend
        if b.rms_norm is not rms_norm_fixed or self.act is not b.silu:
            return False
        mlp = (layer.gate_up, layer.down) if layer.moe is None else ()  # a mixture: its own (tfq/model/moe.py)
        if isinstance(layer, DeltaLayer):
            return (b.delta_layer is not None and fusable(layer.in_proj, layer.out_proj, *mlp)
                    and layer.in_proj.bias is None and layer.out_proj.bias is None)
        return ((b.layer if mlp else b.attention_layer) is not None and b.attend is attend_fixed
                and b.store is write and fusable(layer.qkv, layer.o, *mlp))

    def one_call(self, layer: Layer | DeltaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                 index: int, cache_rows: torch.Tensor, batch: AttentionBatch,
                 segments: Segments | None = None) -> torch.Tensor:
        """decoder_layer in one call to the backend (kernels/layer.py)."""
        n, clock = self.layer_sizes, self.layer_clock
        at = AttentionInputs(cos, sin, cache.k[index], cache.v[index], cache_rows, cache.dtype_name, batch) \
            if isinstance(layer, Layer) else None
        if layer.moe is not None:
            x, h = self.backend.attention_layer(x, layer.fused, n, at, clock)
            return x + self.mixture(layer.moe, h, untapped, segments)
        if isinstance(layer, DeltaLayer):
            state = cache.state
            out, proj = self.backend.delta_layer(x, layer.fused, n, self.sizes, DeltaState(
                state.conv[index], state.rec[index], segments.table, state.saved_conv[index], state.saved_rec[index]),
                clock)
            if state.verify_rows:  # the recurrence's inputs of a verify's rows, to roll rejected ones back
                mixed, _, b, a = self.projections(proj)
                state.keep_inputs(index, segments, mixed, a, b)
            return out
        return self.backend.layer(x, layer.fused, n, at, clock)

    def logits(self, x: torch.Tensor, tap: Tap = untapped) -> torch.Tensor:
        """The final norm and the head over the rows that draw; fp32 logits on the CPU."""
        h = tap("final norm", self.backend.rms_norm(x, self.norm, self.config.rms_eps))
        return self.joined("head", tap("head", self.lm_head(h))).cpu()
