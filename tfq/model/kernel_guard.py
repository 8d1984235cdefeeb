"""Start-up proofs of the kernels, run once a process when a model loads: linear layers and attention give a
row the same bits whatever rows share the call (tfq/engine/layer_guard.py then proves the model's whole layer).

tfq's own linear kernel is row-invariant by construction, and oneDNN's pre-packed linear (its fallback) is a
private op whose row invariance is measured, not promised; either way `check_linear`
proves it on generic shapes and `check_layers` on the model's own layers before tfq trusts it. The same
checks guard the Triton backend's linear layer and attention on a GPU (`ensure_exact`).
"""
from __future__ import annotations

from typing import Callable

import torch
import xxhash

from tfq.errors import TfqError
from tfq.kernels.attention import attend, tile_count
from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS, AttentionBatch, Chunk, DecodeGroup, LinearFn
from tfq.kernels.quant import Quantized

CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 48, 63)
TORCH_FIX = "use tfq's own kernels (TFQ_CPU_KERNELS=tfq, which needs gcc) or a torch build with oneDNN"


def check_linear(make: Callable[[torch.Tensor, torch.Tensor], LinearFn] | None = None, rows: int = 64,
                 device: torch.device | str = "cpu", fix: str = TORCH_FIX) -> None:
    """Refuse to run if a linear row's bits change with the number of rows in the matmul.

    Checks a few shapes like the model's (square, wide, tall) at the row counts where MKL and oneDNN switch
    kernels, against one call of `rows` rows. tests/test_arithmetic.py sweeps the default model's shapes at
    every size the engine runs (1..64 rows, then steps up to 4096; the head up to 80), and tfq/engine/layer_guard.py
    proves the loaded model's own layer up to the plan's largest forward at start. `make`: the CPU backend's
    linear layer unless given.
    """
    if make is None:
        from tfq.kernels.backend import torch_backend

        make = torch_backend().linear
    g = torch.Generator().manual_seed(1234)
    for n_in, n_out in ((96, 96), (64, 352), (352, 64), (896, 128), (4864, 64)):
        w = torch.randn(n_out, n_in, generator=g)
        b = torch.randn(n_out, generator=g)
        check_rows(make(w.to(device), b.to(device)), n_in, f"shape {n_in}->{n_out}", rows, g, device, fix)


def check_rows(f: LinearFn, n_in: int, what: str, rows: int = 64, g: torch.Generator | None = None,
               device: torch.device | str = "cpu", fix: str = TORCH_FIX) -> None:
    """A row's bits must not change with the rows beside it: fewer rows, or the same rows in reverse order. Rows
    are compared by their digests, so at most one call's output is held at a time (a 152k-word head's 64 rows are
    39 MB; the outputs held side by side were most of a load's peak memory)."""
    x = torch.randn(rows, n_in, generator=g).to(device)
    full = _row_digests(f(x))
    for m in CHECK_ROWS:
        if m <= rows and _row_digests(f(x[:m])) != full[:m]:
            raise TfqError(f"this build's linear layer is not batch-invariant (a row's bits change at {m} rows, "
                           f"{what}); exact mode cannot run here: {fix}")
    if _row_digests(f(x.flip(0)))[::-1] != full:
        raise TfqError(f"this build's linear layer is not batch-invariant (a row's bits change with its place "
                       f"among {rows} rows, {what}); exact mode cannot run here: {fix}")


def _row_digests(out: torch.Tensor) -> list[int]:
    """Each row's bits hashed (XXH3, 64 bits)."""
    return [xxhash.xxh3_64_intdigest(row.numpy()) for row in out.cpu().contiguous().view(torch.uint8)]


def check_layers(layers: dict, backend) -> None:
    """The same proof on a model's own linear layers (its real shapes and weights), on their backend."""
    if backend.interpreted:  # too slow there; tests/test_triton_engine.py proves the same
        return
    g = torch.Generator().manual_seed(4321)
    for name, f in layers.items():
        check_rows(f, f.in_features, name, rows=CHECK_ROWS[-1] + 1, g=g, device=backend.device, fix=_fix(backend))


COLUMN_ROWS = 320  # weight rows (output columns) each matrix is proved on: several 64-wide panels and a tail


def check_columns(matrices: dict, make: Callable, backend) -> None:
    """Refuse to split a model over ranks if an output column's bits change with the columns computed beside it
    (the column analogue of row invariance: a rank computes only its share of a layer's outputs).

    `matrices`: name -> (weight, bias or None), fp32 or quantized, the model's own; `make`: how the model
    builds a layer from them. Each matrix's first COLUMN_ROWS rows are computed whole, then cut at widths and
    offsets off the kernel's 16-lane vectors and 64-wide panels; every cut must give the whole's bits.
    """
    if backend.interpreted:
        return
    g = torch.Generator().manual_seed(2468)
    for name, (w, b) in matrices.items():
        n = min(w.shape[0], COLUMN_ROWS)
        x = torch.randn(17, w.shape[1], generator=g).to(backend.device)
        dev = backend.device
        whole = make(_rows(w, 0, n, dev), None if b is None else b[:n].to(dev))(x)
        for start, stop in ((0, 1), (1, 8), (5, 72), (n // 3, n // 3 + 130), (n - 65, n), (0, n - 1)):
            start, stop = max(0, start), min(n, stop)
            if stop <= start:
                continue
            part = make(_rows(w, start, stop, dev), None if b is None else b[start:stop].to(dev))(x)
            if not torch.equal(part, whole[:, start:stop]):
                raise TfqError(f"this build's linear layer is not column-invariant "
                               f"({name}'s outputs {start}..{stop - 1} change when computed apart from the others), "
                               f"so tp > 1 would change bits: set tp: 1, or {_fix(backend)}")


def _rows(w, start: int, stop: int, device):
    """Rows [start, stop) of a weight matrix, fp32 or quantized."""
    if isinstance(w, Quantized):
        return w.select(torch.arange(start, stop))
    return w[start:stop].float().contiguous().to(device)


def _fix(backend) -> str:
    """How a user gets past a failed check on `backend`."""
    return TORCH_FIX if backend.name == "torch" else "run on the CPU (device: cpu)"


def check_attention(attend_fn=None, device: torch.device | str = "cpu", fix: str = "use the torch build tfq was "
                    "measured on (see README)") -> None:
    """Refuse to run if the attention kernels give a row other bits in a decode than in a prompt chunk."""
    problem = attention_differs(attend_fn, device)
    if problem:
        raise TfqError(f"this build's attention is not batch-invariant ({problem}); exact mode cannot run here: "
                       f"{fix}")


_checked: set[tuple[str, str]] = set()


def ensure_exact(backend=None) -> None:
    """Run the start-up checks once per process and backend (kernels.backend.Backend; None: torch)."""
    if backend is None:
        from tfq.kernels.backend import torch_backend

        backend = torch_backend()
    key = (backend.name, str(backend.device))
    if key in _checked:
        return
    if backend.name == "torch":
        check_linear(backend.linear)
        check_attention(backend.attend)
    elif not backend.interpreted:  # too slow there; tests/test_triton_engine.py proves the same
        check_linear(backend.linear, device=backend.device, fix=_fix(backend))
        check_attention(backend.attend, backend.device, _fix(backend))
    _checked.add(key)


def attention_differs(attend_fn=None, device: torch.device | str = "cpu") -> str | None:
    """Prove on the running build that a row's attention bits do not depend on how it is computed.

    A row at position p, taken from one prompt chunk, must equal the same row as a one-row decode beside a
    stream of another length, in both arithmetics. Returns None when it holds, else what differed.
    """
    attend_fn = attend_fn or attend
    g = torch.Generator().manual_seed(99)
    hkv, group, dim, length = 2, 3, 64, 2 * SPLIT_ROWS + 40
    k = torch.randn(4 * length, hkv, dim, generator=g).to(device)
    v = torch.randn(4 * length, hkv, dim, generator=g).to(device)
    q = torch.randn(length, hkv * group, dim, generator=g).to(device)
    pad = tile_count(length) * KEY_TILE
    rows = torch.arange(pad)
    for partial in (False, True):
        whole = attend_fn(q, k, v, AttentionBatch(None, [Chunk(0, length, 0, rows)], partial), 0.125)
        for pos in (0, KEY_TILE, SPLIT_ROWS + 7, length - 1):
            other = torch.arange(2 * length, 2 * length + pad)
            d = DecodeGroup(torch.tensor([0, 1]), torch.stack([other, rows]), torch.tensor([length - 3, pos + 1]))
            one = attend_fn(torch.stack([q[5], q[pos]]), k, v, AttentionBatch(d, [], partial), 0.125)[1]
            # alone, with only its own tiles: a small group (the other decode layout of the torch kernels)
            own = rows[:tile_count(pos + 1) * KEY_TILE][None]
            own_group = DecodeGroup(torch.tensor([0]), own, torch.tensor([pos + 1]))
            alone = attend_fn(q[pos][None], k, v, AttentionBatch(own_group, [], partial), 0.125)[0]
            if not (torch.equal(one, whole[pos]) and torch.equal(alone, whole[pos])):
                return f"{'partial' if partial else 'rows'} attention at position {pos}: decode != prompt chunk"
    return None
