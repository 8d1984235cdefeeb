"""The model's per-row layers in torch (the CPU path): the linear layer, RMS norm and the activation.

Each gives a row the same bits whatever other rows share its call, at any thread count. That is measured,
not promised by torch, so the start-up proofs (tfq/proofs/startup.py) check all three on the running build.

The linear layer: on this CPU plain fp32 `F.linear` gives a row different bits for M = 1, 2-3 and >= 4 (MKL
picks other kernels). oneDNN's pre-packed fp32 inner product is invariant from 2 rows up (swept to 4096 in
tests/test_arithmetic.py), and for 1 row too while rows are short (896), but not for long rows (4864, the
MLP's down projection): one row goes through another kernel. So a lone row is padded to two.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """y = x W^T + b in fp32, row-invariant. Weights are packed once for oneDNN when it is there."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.packed = _onednn_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return _rowwise_linear(x, self.weight, self.bias)
        if x.shape[0] == 1:  # oneDNN runs one row through another kernel (other bits for long rows): pad to two
            return self._packed(torch.cat([x, x.new_zeros(x.shape)]))[:1]
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _rowwise_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # Fallback without oneDNN: one matrix-vector product per row is invariant by construction (slow).
    return torch.stack([F.linear(row[None], w, b)[0] for row in x]) if len(x) else F.linear(x, w, b)


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
