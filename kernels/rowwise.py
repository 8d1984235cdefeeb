"""The model's per-row norm and its activation in torch (the CPU path); the linear layers are tfq.arithmetic.Linear.

Norms are measured batch-invariant on this CPU: a row's mean over its own last dimension does not depend on
the other rows. The start-up guard (tfq/guard.py) proves both on the running build at every thread count.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written so that every element takes the same path at any thread count.

    torch splits an elementwise op into one chunk per thread. `F.silu` (and `torch.sigmoid`) compute the
    elements that do not fill a whole vector at the end of a chunk with the scalar exp, which rounds
    differently from the vector one, so at 3 or more threads a row's bits depend on how many rows share the
    call. `torch.exp` finishes a chunk with a partial vector instead; negation, addition and division round
    the same on either path. Measured invariant at 1 to 16 threads; the guard proves it at start.
    """
    return x / (1 + torch.exp(-x))
