"""The model's per-row layers on the CPU: the linear layer, RMS norm and the activation.

Each gives a row the same bits whatever other rows share its call, at any thread count, and the start-up
proofs (tfq/engine/layer_guard.py) check all three on the running build.

The linear layer is tfq's own C++ kernel (kernels/cpu/linear.cpp, `FixedOrderLinear`): every output summed in
one fixed order, so row invariance holds by construction, and it streams the weights faster than oneDNN does
in a decode step. Where it cannot be built (no compiler), or with TFQ_CPU_KERNELS=torch, oneDNN's packed fp32
inner product is used (`OneDnnLinear`), whose invariance is measured instead:

On this CPU plain fp32 `F.linear` gives a row different bits for M = 1, 2-3 and >= 4 (MKL
picks other kernels). oneDNN's pre-packed fp32 inner product is invariant from 2 rows up (swept to 4096 in
tests/test_arithmetic.py), and for 1 row too while rows are short (896), but not for long rows (4864, the
MLP's down projection): one row goes through another kernel. So a lone row is padded to two where that
happens. Which shapes need it is measured when a layer is made (a lone row against the same row in a pair, at
several thread counts), since it depends on the CPU and the build; padding costs a second row's products and
a copy, so the shapes that do not need it skip it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_build

PROBE_THREADS = (1, 2, 3, 4)  # thread counts the lone-row probe tries, besides the current one


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class FixedOrderLinear:
    """y = x W^T + b by kernels/cpu/linear.cpp: each output one fixed-order sum (row-invariant by construction).
    The weights are packed once into panels of 64 outputs ([N / 64][K][64])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.panels = cpu_build.op("pack")(weight.detach().float().contiguous())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_build.op("linear")(x.contiguous(), self.panels, self.bias, self.out_features)


class OneDnnLinear:
    """y = x W^T + b in fp32, row-invariant as measured. Weights are packed once for oneDNN when it is there."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.packed = onednn_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        self.pad_lone = self.packed and not _lone_row_agrees(self)
        self._pair = torch.zeros(2, self.in_features) if self.pad_lone else None  # row 1 stays zero

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return _rowwise_linear(x, self.weight, self.bias)
        if x.shape[0] == 1 and self.pad_lone:  # oneDNN would run this lone row through another kernel
            self._pair[0].copy_(x[0])
            return self._packed(self._pair)[:1]
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


_LONE_ROW: dict[tuple[int, int, int], bool] = {}  # (out, in, threads) -> whether a lone row agrees, measured


def _lone_row_agrees(layer: OneDnnLinear) -> bool:
    """Whether oneDNN gives a lone row the bits it gives the same row beside another, at the usual thread
    counts (the start-up guard then proves the layer at every count the engine runs)."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(layer.in_features)
    x = torch.randn(2, layer.in_features, generator=g)
    try:
        for n in sorted({*PROBE_THREADS, threads}):
            key = (layer.out_features, layer.in_features, n)
            if key not in _LONE_ROW:
                torch.set_num_threads(n)
                _LONE_ROW[key] = torch.equal(layer._packed(x[:1]), layer._packed(x)[:1])
            if not _LONE_ROW[key]:
                return False
    finally:
        torch.set_num_threads(threads)
    return True


def _rowwise_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # Fallback without oneDNN: one matrix-vector product per row is invariant by construction (slow).
    return torch.stack([F.linear(row[None], w, b)[0] for row in x]) if len(x) else F.linear(x, w, b)


def rms_norm_fixed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm by kernels/cpu/rowwise.cpp: each row's sum of squares in one fixed order."""
    return cpu_build.op("rms_norm")(x.contiguous(), weight, eps)


def silu_fixed(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) by kernels/cpu/rowwise.cpp, with tfq's own exp: one op, the same bits everywhere."""
    return cpu_build.op("silu")(x.contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension (torch's own op: one call, not five)."""
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written so that every element takes the same path at any thread count.

    torch splits an elementwise op into one chunk per thread. `F.silu` (and `torch.sigmoid`) compute the
    elements that do not fill a whole vector at the end of a chunk with the scalar exp, which rounds
    differently from the vector one, so at 3 or more threads a row's bits depend on how many rows share the
    call. `torch.exp` finishes a chunk with a partial vector instead; negation, addition and division round
    the same on either path. Measured invariant at 1 to 16 threads; the guard proves it at start.
    """
    return x / torch.neg(x).exp_().add_(1)  # in place after the first op: the same ops, fewer tensors
