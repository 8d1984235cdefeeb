"""The linear layer's invariance, proven on this build, and the guard that refuses a path that is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfq.kernels.rowwise import Linear
from tfq.proofs.startup_kernels import check_linear, check_rows
from tfq.errors import TfqError


# The default model's layers (qkv, o, gate_up, down) and the sizes the engine runs them at: every row count
# from 1 to 64, then steps across the powers of two up to the default plan's largest forward (8 lanes x
# 512-row chunks); the head only ever sees the rows that draw (lanes x (1 + guesses)), so up to 64 and a few more.
LAYERS = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]
LARGEST = 8 * 512
STEPS = (65, 127, 129, 255, 257, 511, 513, 1023, 1025, 2047, 2049, 4095)


def sweep(f, x: torch.Tensor, sizes) -> list[int]:
    """Row counts at which a prefix's rows differ from the same rows in the full call."""
    full = f(x)
    bad = [m for m in sizes if not torch.equal(f(x[:m]), full[:m])]
    if not torch.equal(f(x.flip(0)), full.flip(0)):
        bad.append(-len(x))  # a row's place in the batch changed its bits
    return bad


@pytest.mark.parametrize("n_in, n_out", LAYERS)
def test_linear_row_bits_hold_at_every_size_the_engine_runs(n_in, n_out):
    g = torch.Generator().manual_seed(n_in + n_out)
    f = Linear(torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g))
    x = torch.randn(LARGEST, n_in, generator=g)
    assert sweep(f, x, [*range(1, 65), *STEPS]) == []


def test_the_head_row_bits_hold_at_every_size_it_runs():
    g = torch.Generator().manual_seed(151936)
    f = Linear(torch.randn(151936, 896, generator=g))
    x = torch.randn(96, 896, generator=g)
    assert sweep(f, x, [*range(1, 65), 80]) == []


def test_guard_accepts_the_engine_linear():
    check_linear()


def test_guard_refuses_plain_linear():
    """Plain fp32 F.linear changes a row's bits with M here (docs/contract.md): the guard must say no."""
    with pytest.raises(TfqError, match="not batch-invariant"):
        check_linear(lambda w, b: (lambda x: F.linear(x, w, b)))


def test_guard_refuses_a_subtly_wrong_path():
    """A path that is right for one row but sums differently in a batch (a control that must be caught)."""
    def make(w, b):
        lin = Linear(w, b)
        return lambda x: lin(x) if len(x) == 1 else lin(x) + (lin(x) * 1e-7)
    with pytest.raises(TfqError):
        check_linear(make)


def test_attention_guard_passes_and_catches_a_shape_dependent_kernel():
    from tfq.kernels.attention import attend
    from tfq.proofs.startup_kernels import attention_differs, check_attention

    assert attention_differs() is None
    check_attention()

    def decode_differs(q, k, v, batch, scale):  # a kernel whose one-row path sums differently
        out = attend(q, k, v, batch, scale)
        return out * (1 + 1e-7) if batch.decode is not None else out

    assert "decode != prompt chunk" in attention_differs(decode_differs)


def test_guard_refuses_onednn_without_the_one_row_padding():
    """oneDNN alone runs a lone long row through another kernel: the guard must catch exactly that."""
    def make(w, b):
        lin = Linear(w, b)
        return lin._packed
    with pytest.raises(TfqError, match="at 1 rows"):
        check_linear(make)


def _lone_row_differs(monkeypatch):
    """A oneDNN stand-in whose one-row kernel rounds differently (by construction, not by a build's luck)."""
    from tfq.kernels import rowwise

    real = Linear._packed

    def packed(self, x):
        y = real(self, x)
        return y * (1 + 2 ** -20) if x.shape[0] == 1 else y

    monkeypatch.setattr(Linear, "_packed", packed)
    monkeypatch.setattr(rowwise, "_LONE_ROW", {})  # measure again, on the stand-in


def test_a_layer_pads_a_lone_row_when_its_kernel_would_change_the_row(monkeypatch):
    _lone_row_differs(monkeypatch)
    g = torch.Generator().manual_seed(5)
    lin = Linear(torch.randn(64, 96, generator=g), torch.randn(64, generator=g))
    assert lin.pad_lone
    x = torch.randn(5, 96, generator=g)
    assert all(torch.equal(lin(x[i:i + 1]), lin(x)[i:i + 1]) for i in range(5))


def test_control_a_layer_that_skips_the_padding_is_red(monkeypatch):
    _lone_row_differs(monkeypatch)
    g = torch.Generator().manual_seed(5)
    lin = Linear(torch.randn(64, 96, generator=g), torch.randn(64, generator=g))
    lin.pad_lone = False  # trust the lone-row kernel without measuring it
    x = torch.randn(5, 96, generator=g)
    assert not torch.equal(lin(x[:1]), lin(x)[:1])
    with pytest.raises(TfqError, match="at 1 rows"):
        check_rows(lin, 96, "the stand-in")
