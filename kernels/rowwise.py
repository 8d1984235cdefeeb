"""The model's per-row norm in torch (the CPU path); the linear layers are tfq.arithmetic.Linear.

Norms are measured batch-invariant on this CPU (DESIGN.md section 2): a row's mean over its own last
dimension does not depend on the other rows.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
