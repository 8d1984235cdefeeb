"""The recipe of kernels/cpu/quant_q8.cpp (`weights: gguf-q8`) written with torch's elementwise operations, each
rounding once as the kernel's do: the reference the start-up guard and the tests hold the kernel to, bit for bit.

1. x rounded per block of 32 inputs: amax = max |x|, d = amax / 127, q = round(x * (127 / amax)) to nearest,
   ties to even, in [-127, 127]; a block whose amax is below 2^-100 is zero (d = 0), one with a NaN or an
   infinity has d = NaN.
2. Each group of the weights (w = s (q - zero) + o): i = sum (q_w - zero) q_x and b = sum q_x, exact integers.
3. t = s * float(i) (+ o * float(b)); acc = acc + d * t, groups in input order from +0; y = acc + bias.
"""
from __future__ import annotations

import torch

BLOCK = 32
TINY = 2.0 ** -100


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] int64, d [M, K / 32] fp32): step 1."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros(())).amax(-1)
    zero = ~finite | (amax < TINY)
    safe = torch.where(zero, torch.ones(()), amax)
    inv = torch.tensor(127.0) / safe
    q = torch.round(torch.where(finite[..., None], xb, torch.zeros(())) * inv[..., None]).clamp(-127, 127)
    q = torch.where(zero[..., None], torch.zeros(()), q)
    d = torch.where(zero, torch.zeros(()), amax / torch.tensor(127.0))
    d = torch.where(finite, d, torch.full((), float("nan")))
    return q.reshape(m, k).long(), d


def reference(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b by the recipe, for a `Quantized` weight (tfq.kernels.quant)."""
    q, d = round_activations(x)
    n, k = weight.shape
    g = weight.group
    ints = weight.ints().long().reshape(n, k // g, g)  # q_w - zero
    qx = q.reshape(q.shape[0], k // g, g)
    i = torch.einsum("mgk,ngk->mng", qx, ints)  # exact: int64
    b = qx.sum(-1)  # [M, groups]
    t = weight.s.float()[None] * i.float()
    if weight.o is not None:
        t = t + weight.o.float()[None] * b.float()[:, None, :]
    acc = torch.zeros(q.shape[0], n)
    for j in range(k // g):
        acc = acc + d[:, (j * g) // BLOCK, None] * t[:, :, j]
    return acc + (bias.float() if bias is not None else 0.0)
