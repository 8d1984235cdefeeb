"""The rotary embedding's frequencies, plain or scaled (linear, YaRN), computed as HF transformers computes them.

Every operation follows transformers' `modeling_rope_utils` step by step, in fp32 on the CPU, except that the
power and the cos and sin are rounded to the nearest float32 (tfq/nearest.py), where torch's vector code has
another last bit on another instruction set: the tables are the same on every CPU, and within an ulp of HF's.
The frequencies never depend on the sequence length: a row's angles are the same whatever batch it is in
("dynamic" scaling is refused in tfq.model.config for that reason).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tfq.nearest import cos32, pow32, sin32

if TYPE_CHECKING:
    from tfq.model.config import ModelConfig


def inv_freq_and_scale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, attention factor): the angle of position p, pair i is p * inv_freq[i];
    cos and sin are multiplied by the factor (1.0 without scaling, where the multiply is left out)."""
    dim, base, s = config.rotary_dim, config.rope_theta, config.rope_scaling
    pos_freqs = torch.from_numpy(pow32(base, (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim).numpy()))
    if s is None:
        return 1.0 / pos_freqs, 1.0
    if s.kind == "linear":
        return 1.0 / pos_freqs / s.factor, 1.0
    if s.kind != "yarn":
        raise ValueError(f"unknown rope scaling kind {s.kind!r}")
    # YaRN: interpolate the low frequencies (scaled by 1 / factor), keep the high ones, and blend the two by
    # a linear ramp over the dimensions between beta_fast and beta_slow rotations in the original context.
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    low, high = _correction_range(s.beta_fast, s.beta_slow, dim, base, s.original_max_positions, s.truncate)
    keep = 1 - _linear_ramp(low, high, dim // 2)
    return interpolation * (1 - keep) + extrapolation * keep, s.attention_factor


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension whose wavelength makes `rotations` turns over `max_positions` positions."""
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _correction_range(fast: float, slow: float, dim: int, base: float, max_positions: int,
                      truncate: bool) -> tuple[float, float]:
    low = _correction_dim(fast, dim, base, max_positions)
    high = _correction_dim(slow, dim, base, max_positions)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # as HF: no division by zero
    return torch.clamp((torch.arange(n, dtype=torch.float32) - low) / (high - low), 0, 1)


def rope_tables(config: ModelConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, head_dim] fp32 for positions 0..rows-1 in HF's half-split layout, the attention
    factor applied as HF applies it (after cos and sin). tfq's `rotate` takes sin with its first half negated."""
    inv_freq, scale = inv_freq_and_scale(config)
    freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
    cos, sin = (torch.from_numpy(f(freqs.numpy())).repeat(1, 2) for f in (cos32, sin32))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin
