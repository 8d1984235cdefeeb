"""A whole decoder layer in one call to tfq's C++ kernels (kernels/cpu/layer.cpp for attention layers, a
hybrid's gated ones included; kernels/cpu/delta_layer.cpp for a hybrid's DeltaNet layers): the same ops in the
same order as the layer written op by op (tfq/model/qwen.py), so the same bits by construction, and the start-up
guard checks on the running build that both give every row the same bits (tfq/engine/layer_guard.py).

It exists for speed alone: at one lane a decode step spent several milliseconds between its linear layers
dispatching ~25 small ops a layer from Python, each on cold caches after a linear layer's stream of weights.
"""
from __future__ import annotations

import torch

from . import cpu_build
from .attention import attention_tables
from .contract import KEY_TILE, SATURATE, SPLIT_ROWS, AttentionBatch
from .delta import DeltaSizes, DeltaWeights
from .quant import QuantLinear
from .rowwise import FixedOrderLinear


def fusable(*linears) -> bool:
    """Whether these layers are tfq's C++ linear kernels (fp32 panels or quantized blobs), which the one-call
    layer runs (and nothing else)."""
    return all(type(f) in (FixedOrderLinear, QuantLinear) for f in linears)


def decoder_layer_fixed(x: torch.Tensor, input_norm: torch.Tensor, qkv: FixedOrderLinear,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                        cache_dtype: str, batch: AttentionBatch, scale: float, o: FixedOrderLinear,
                        post_norm: torch.Tensor, gate_up: FixedOrderLinear, down: FixedOrderLinear, heads: int,
                        kv_heads: int, head_dim: int, intermediate: int, eps: float, gated: bool = False,
                        clock: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, hidden] through one layer; its keys and values go to the cache at `rows`. Rotary turns each head's
    first cos.shape[-1] dimensions; `gated`: a hybrid's attention, qkv's last rows a gate of its output. `clock`
    (float64 [2]), when given, gains the seconds spent in linear layers and in attention."""
    table, offsets, lengths = attention_tables(batch, x.shape[0])
    return cpu_build.op("layer")(
        x, input_norm, qkv.panels, qkv.bias, q_norm, k_norm, cos, sin, k_cache, v_cache, rows,
        SATURATE.get(cache_dtype, 0.0), table, offsets, lengths, scale, KEY_TILE,
        SPLIT_ROWS if batch.partial else 0, o.panels, post_norm, gate_up.panels, down.panels, heads, kv_heads,
        head_dim, intermediate, eps, gated, clock)


def attention_layer_fixed(x: torch.Tensor, input_norm: torch.Tensor, qkv: FixedOrderLinear,
                          q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                          cache_dtype: str, batch: AttentionBatch, scale: float, o: FixedOrderLinear,
                          post_norm: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                          gated: bool = False, clock: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts layer's attention half in one call: (x + the attention's output projected, its post
    norm), the ops of decoder_layer_fixed before its MLP."""
    table, offsets, lengths = attention_tables(batch, x.shape[0])
    return cpu_build.op("attention_layer")(
        x, input_norm, qkv.panels, qkv.bias, q_norm, k_norm, cos, sin, k_cache, v_cache, rows,
        SATURATE.get(cache_dtype, 0.0), table, offsets, lengths, scale, KEY_TILE,
        SPLIT_ROWS if batch.partial else 0, o.panels, post_norm, heads, kv_heads, head_dim, eps, gated, clock)


def delta_layer_fixed(x: torch.Tensor, input_norm: torch.Tensor, in_proj: FixedOrderLinear, mixer: DeltaWeights,
                      conv_state: torch.Tensor, rec_state: torch.Tensor, segments: torch.Tensor,
                      save_conv: torch.Tensor, save_rec: torch.Tensor, sizes: DeltaSizes, out_proj: FixedOrderLinear,
                      post_norm: torch.Tensor, gate_up: FixedOrderLinear, down: FixedOrderLinear, intermediate: int,
                      eps: float, clock: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, hidden] through a hybrid's DeltaNet layer, the states of the segments' slots updated in place (and
    saved first where a segment says so, as kernels.delta.deltanet_rows does). Returns (the output, in_proj's
    output: qkv | z | b | a, from which a draft verify keeps the recurrence's inputs). `clock` gains the seconds
    of linear layers ([0]) and of the recurrence ([1])."""
    n = sizes
    return cpu_build.op("delta_layer")(
        x, input_norm, in_proj.panels, mixer.conv, mixer.A, mixer.dt_bias, mixer.norm, conv_state, rec_state,
        segments, save_conv, save_rec, n.key_heads, n.key_dim, n.value_heads, n.value_dim, out_proj.panels,
        post_norm, gate_up.panels, down.panels, intermediate, eps, clock)
