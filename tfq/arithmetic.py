"""Linear layers whose rows do not depend on how many rows the matmul has.

On this CPU plain fp32 `F.linear` gives a row different bits for M = 1, 2-3 and >= 4 (MKL picks other
kernels). oneDNN's pre-packed fp32 inner product is invariant for M = 2..600 (measured), and for M = 1 too
while rows are short (896), but not for long rows (4864, the MLP's down projection): one row goes through
another kernel. So a lone row is padded to two. It is the fastest fp32 path here, and a private op, so
`check_linear` proves it on the running build, and `check_layers` on the model's own layers, before tfq
trusts it. The same checks guard the Triton backend's linear layer and attention on a GPU (`ensure_exact`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.backend import LinearFn
from tfq.errors import TfqError



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


CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 48, 63)
TORCH_FIX = "use a torch build with oneDNN (mkldnn)"


def check_linear(make: Callable[[torch.Tensor, torch.Tensor], LinearFn] = Linear, rows: int = 64,
                 device: torch.device | str = "cpu", fix: str = TORCH_FIX) -> None:
    """Refuse to run if a linear row's bits change with the number of rows in the matmul.

    Checks a few shapes like the model's (square, wide, tall) at the row counts where MKL and oneDNN switch
    kernels, against one call of `rows` rows. tests/test_arithmetic.py sweeps the default model's shapes at
    every size the engine runs (1..64 rows, then steps up to 4096; the head up to 80), and tfq/guard.py
    proves the loaded model's own layer up to the plan's largest forward at start.
    """
    g = torch.Generator().manual_seed(1234)
    for n_in, n_out in ((96, 96), (64, 352), (352, 64), (896, 128), (4864, 64)):
        w = torch.randn(n_out, n_in, generator=g)
        b = torch.randn(n_out, generator=g)
        check_rows(make(w.to(device), b.to(device)), n_in, f"shape {n_in}->{n_out}", rows, g, device, fix)


def check_rows(f: LinearFn, n_in: int, what: str, rows: int = 64, g: torch.Generator | None = None,
               device: torch.device | str = "cpu", fix: str = TORCH_FIX) -> None:
    """A row's bits must not change with the rows beside it: fewer rows, or the same rows in reverse order."""
    x = torch.randn(rows, n_in, generator=g).to(device)
    full = f(x)
    for m in CHECK_ROWS:
        if m <= rows and not torch.equal(f(x[:m]), full[:m]):
            raise TfqError(f"this build's linear layer is not batch-invariant (a row's bits change at {m} rows, "
                           f"{what}); exact mode cannot run here: {fix}")
    if not torch.equal(f(x.flip(0)), full.flip(0)):
        raise TfqError(f"this build's linear layer is not batch-invariant (a row's bits change with its place "
                       f"among {rows} rows, {what}); exact mode cannot run here: {fix}")


def check_layers(layers: dict, backend) -> None:
    """The same proof on a model's own linear layers (its real shapes and weights), on their backend."""
    if backend.interpreted:  # too slow there; tests/test_triton_engine.py proves the same
        return
    g = torch.Generator().manual_seed(4321)
    for name, f in layers.items():
        check_rows(f, f.in_features, name, rows=CHECK_ROWS[-1] + 1, g=g, device=backend.device, fix=_fix(backend))


def _fix(backend) -> str:
    """How a user gets past a failed check on `backend`."""
    return TORCH_FIX if backend.name == "torch" else "run on the CPU (device: cpu)"


def check_attention(attend_fn=None, device: torch.device | str = "cpu", fix: str = "use the torch build tfq was "
                    "measured on (see README)") -> None:
    """Refuse to run if the attention kernels give a row other bits in a decode than in a prompt chunk."""
    from kernels.attention import check_attention as differs

    problem = differs(attend_fn, device)
    if problem:
        raise TfqError(f"this build's attention is not batch-invariant ({problem}); exact mode cannot run here: "
                       f"{fix}")


_checked: set[tuple[str, str]] = set()


def ensure_exact(backend=None) -> None:
    """Run the start-up checks once per process and backend (kernels.backend.Backend; None: torch)."""
    if backend is None:
        from kernels.backend import torch_backend
        backend = torch_backend()
    key = (backend.name, str(backend.device))
    if key in _checked:
        return
    if backend.name == "torch":
        check_linear()
        check_attention()
    elif not backend.interpreted:  # too slow there; tests/test_triton_engine.py proves the same
        check_linear(backend.linear, device=backend.device, fix=_fix(backend))
        check_attention(backend.attend, backend.device, _fix(backend))
    _checked.add(key)
