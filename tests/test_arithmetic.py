"""The linear layer's invariance, proven on this build, and the guard that refuses a path that is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfq.errors import TfqError
from tfq.kernels.backend import torch_backend
from tfq.kernels.rowwise import FixedOrderLinear, OneDnnLinear
from tfq.model.kernel_guard import check_linear, check_rows

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


IMPLEMENTATIONS = [FixedOrderLinear, OneDnnLinear]  # tfq's kernel (the default) and oneDNN (its fallback)


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@pytest.mark.parametrize("n_in, n_out", LAYERS)
def test_linear_row_bits_hold_at_every_size_the_engine_runs(n_in, n_out, make):
    g = torch.Generator().manual_seed(n_in + n_out)
    f = make(torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g))
    x = torch.randn(LARGEST, n_in, generator=g)
    assert sweep(f, x, [*range(1, 65), *STEPS]) == []


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
def test_the_head_row_bits_hold_at_every_size_it_runs(make):
    g = torch.Generator().manual_seed(151936)
    f = make(torch.randn(151936, 896, generator=g))
    x = torch.randn(96, 896, generator=g)
    assert sweep(f, x, [*range(1, 65), 80]) == []


def test_the_engine_linear_is_tfqs_kernel_unless_told():
    # this machine has gcc: the kernel builds
    assert isinstance(torch_backend().linear(torch.ones(4, 16)), FixedOrderLinear)


def test_torch_kernels_on_request(monkeypatch):
    from tfq.kernels.attention import attend
    from tfq.kernels.backend import torch_backend

    monkeypatch.setenv("TFQ_CPU_KERNELS", "torch")
    assert isinstance(torch_backend().linear(torch.ones(4, 16)), OneDnnLinear)
    assert torch_backend().attend is attend and "oneDNN" in torch_backend().where
    monkeypatch.setenv("TFQ_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="choose auto, tfq"):
        torch_backend().linear(torch.ones(4, 16))


def test_a_bad_linear_choice_is_one_line(monkeypatch, capsys, tiny_dirs):
    from cli import tfq

    monkeypatch.setenv("TFQ_CPU_KERNELS", "fast")
    code, out, err = tfq(["chat", "--model", str(tiny_dirs["qwen2"]), "--quiet", "hi"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "TFQ_CPU_KERNELS='fast'" in err, err


@pytest.mark.parametrize("n_in", [16, 90, 896, 4864])
@pytest.mark.parametrize("rows", [3, 40, 100])  # the kernel's three ways through a panel (linear.cpp: panel_rows)
def test_the_kernel_sums_each_output_in_its_fixed_order(n_in, rows):
    """Every output is acc = fma(x[k], w[k], acc) for k = 0, 1, ... in order (from 0), then + bias: computed here
    in numpy, one rounding a step, the kernel's bits exactly."""
    import numpy as np

    g = torch.Generator().manual_seed(n_in)
    w, b = torch.randn(70, n_in, generator=g), torch.randn(70, generator=g)  # 70: a full panel and part of one
    x = torch.randn(rows, n_in, generator=g)
    got = FixedOrderLinear(w, b)(x).numpy()
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    acc = np.zeros((rows, 70), np.float32)
    for k in range(n_in):  # fma: the exact product (float64 holds it) plus acc, rounded once to float32
        acc = (xs[:, k, None] * ws[None, :, k] + acc).astype(np.float32)
    assert np.array_equal(acc + b.numpy(), got)


def test_control_the_same_sum_in_another_order_is_red():
    """The recipe run backwards (k from the last input to the first), in numpy, parts from the kernel's bits:
    the order is what the bits follow."""
    import numpy as np

    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(64, 896, generator=g), torch.randn(4, 896, generator=g)
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    acc = np.zeros((4, 64), np.float32)
    for k in reversed(range(896)):
        acc = (xs[:, k, None] * ws[None, :, k] + acc).astype(np.float32)
    assert not np.array_equal(acc, FixedOrderLinear(w)(x).numpy())


def test_the_kernel_gives_the_same_bits_at_any_thread_count():
    """Each output is summed by one thread in one order: unlike oneDNN, even the thread count cannot matter."""
    g = torch.Generator().manual_seed(11)
    f = FixedOrderLinear(torch.randn(1000, 896, generator=g), torch.randn(1000, generator=g))
    x = torch.randn(37, 896, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5, 8, 16):
            torch.set_num_threads(n)
            outs.append(f(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_guard_accepts_the_engine_linear():
    check_linear()
    check_linear(OneDnnLinear)


def test_guard_refuses_plain_linear():
    """Plain fp32 F.linear changes a row's bits with M here (docs/contract.md): the guard must say no."""
    with pytest.raises(TfqError, match="not batch-invariant"):
        check_linear(lambda w, b: (lambda x: F.linear(x, w, b)))


def test_guard_refuses_a_subtly_wrong_path():
    """A path that is right for one row but sums differently in a batch (a control that must be caught)."""
    def make(w, b):
        lin = torch_backend().linear(w, b)
        return lambda x: lin(x) if len(x) == 1 else lin(x) + (lin(x) * 1e-7)
    with pytest.raises(TfqError):
        check_linear(make)


def test_attention_guard_passes_and_catches_a_shape_dependent_kernel():
    from tfq.kernels.attention import attend
    from tfq.model.kernel_guard import attention_differs, check_attention

    assert attention_differs() is None
    check_attention()

    def decode_differs(q, k, v, batch, scale):  # a kernel whose one-row path sums differently
        out = attend(q, k, v, batch, scale)
        return out * (1 + 1e-7) if batch.decode is not None else out

    assert "decode != prompt chunk" in attention_differs(decode_differs)


def test_guard_refuses_onednn_without_the_one_row_padding(monkeypatch):
    """oneDNN may run a lone row through another kernel (it does for long rows on AVX-512 Xeons; not on every
    CPU): the guard must catch exactly that. By construction, on a stand-in whose one-row kernel rounds apart."""
    _lone_row_differs(monkeypatch)

    def make(w, b):
        lin = OneDnnLinear(w, b)
        return lin._packed
    with pytest.raises(TfqError, match="at 1 rows"):
        check_linear(make)


def _lone_row_differs(monkeypatch):
    """A oneDNN stand-in whose one-row kernel rounds differently (by construction, not by a build's luck)."""
    from tfq.kernels import rowwise

    real = OneDnnLinear._packed

    def packed(self, x):
        y = real(self, x)
        return y * (1 + 2 ** -20) if x.shape[0] == 1 else y

    monkeypatch.setattr(OneDnnLinear, "_packed", packed)
    monkeypatch.setattr(rowwise, "_LONE_ROW", {})  # measure again, on the stand-in


def test_a_layer_pads_a_lone_row_when_its_kernel_would_change_the_row(monkeypatch):
    _lone_row_differs(monkeypatch)
    g = torch.Generator().manual_seed(5)
    lin = OneDnnLinear(torch.randn(64, 96, generator=g), torch.randn(64, generator=g))
    assert lin.pad_lone
    x = torch.randn(5, 96, generator=g)
    assert all(torch.equal(lin(x[i:i + 1]), lin(x)[i:i + 1]) for i in range(5))


def test_control_a_layer_that_skips_the_padding_is_red(monkeypatch):
    _lone_row_differs(monkeypatch)
    g = torch.Generator().manual_seed(5)
    lin = OneDnnLinear(torch.randn(64, 96, generator=g), torch.randn(64, generator=g))
    lin.pad_lone = False  # trust the lone-row kernel without measuring it
    x = torch.randn(5, 96, generator=g)
    assert not torch.equal(lin(x[:1]), lin(x)[:1])
    with pytest.raises(TfqError, match="at 1 rows"):
        check_rows(lin, 96, "the stand-in")


def test_the_row_wise_kernels_give_a_row_its_bits_anywhere():
    """tfq's RMS norm and SiLU: a row (an element) is one thread's fixed-order work, so its bits are the same
    alone, among other rows and at any thread count; both stay close to float64."""
    from tfq.kernels.rowwise import rms_norm_fixed, silu_fixed

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 896, generator=g) * 3, torch.randn(896, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5, 16):
            torch.set_num_threads(n)
            outs.append((rms_norm_fixed(x, w, 1e-6), silu_fixed(x)))
            for i in (0, 17, 36):
                assert torch.equal(rms_norm_fixed(x[i:i + 1], w, 1e-6), outs[-1][0][i:i + 1])
                assert torch.equal(silu_fixed(x[i:i + 1]), outs[-1][1][i:i + 1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs[1:])
    xd = x.double()
    norm = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert (outs[0][0].double() - norm).abs().max() < 1e-5 * norm.abs().max()
    assert (outs[0][1].double() - xd * torch.sigmoid(xd)).abs().max() < 1e-6 * xd.abs().max()


def _round32(exact):
    """A rational rounded once to fp32, to nearest, ties to even (float() then fp32 can round twice)."""
    from fractions import Fraction

    import numpy as np

    f = np.float32(float(exact))
    best = f
    for g in (np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))):
        db, dg = abs(Fraction(float(best)) - exact), abs(Fraction(float(g)) - exact)
        if dg < db or (dg == db and int(g.view(np.uint32)) % 2 == 0):
            best = g
    return best


def _fma32(a, b, c):
    from fractions import Fraction
    return _round32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _silu_recipe(u, ln2_lo=-2.12194440e-4):
    """docs/contract.md's SiLU, x / (1 + exp(-x)), with tfq's exp, one rounding a step, in exact arithmetic."""
    import numpy as np

    f32 = np.float32
    x = f32(u)
    a = -x
    if not a >= f32(-87.0):
        e = f32(0.0)
    else:
        v = min(a, f32(89.0))
        n = f32(np.rint(v * f32(1.44269504088896341)))
        r = _fma32(-n, f32(0.693359375), v)
        r = _fma32(-n, f32(ln2_lo), r)
        p = f32(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = _fma32(p, r, f32(c))
        y = _fma32(p, r * r, r) + f32(1.0)
        n1 = int(n) >> 1
        e = (y * f32(2.0 ** n1)) * f32(2.0 ** (int(n) - n1))
    return x / (f32(1.0) + e)


SILU_POINTS = [0.0, -0.0, 1e-30, -1e-30, 86.9, 87.0, 87.01, 87.5, 88.7, 88.8, 89.0, 95.0, 200.0,
               -86.9, -87.0, -87.5, -88.7, -88.8, -89.0, -95.0, -200.0, float("inf"), float("-inf")]


def test_the_activation_is_its_recipe_bit_for_bit():
    """tfq's SiLU (and the exp inside it, which attention shares) is docs/contract.md's recipe exactly: computed
    here one rounding a step in exact arithmetic, over random and edge arguments, the kernel's bits. A control
    that skips the second half of ln 2 (`r` loses n * 2e-4) must part."""
    import numpy as np

    from tfq.kernels.rowwise import silu_fixed

    g = torch.Generator().manual_seed(11)
    x = torch.cat([torch.randn(600, generator=g) * 6, torch.rand(200, generator=g) * 200 - 100,
                   torch.tensor(SILU_POINTS)]).float()
    got = silu_fixed(x).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # exp(89) is inf, and -inf / inf is NaN, as in the kernel
        want = np.array([_silu_recipe(u) for u in x.numpy()], dtype=np.float32)
        control = np.array([_silu_recipe(u, ln2_lo=0.0) for u in x.numpy()], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got.view(np.uint32), control.view(np.uint32))
    assert np.isnan(silu_fixed(torch.tensor([float("nan")])).numpy()).all()


def test_loading_says_so_before_the_kernels_compile(tiny_dirs, monkeypatch, capsys):
    from tfq.kernels import cpu_build
    from tfq.model.load import load_model

    monkeypatch.setattr(cpu_build, "built", lambda: False)
    monkeypatch.setattr(cpu_build, "cached", lambda: False)  # as on a machine that never built them
    load_model(str(tiny_dirs["qwen2"]), progress=True)
    assert "building its CPU kernels for this machine" in capsys.readouterr().err
    monkeypatch.setattr(cpu_build, "cached", lambda: True)
    load_model(str(tiny_dirs["qwen2"]), progress=True)
    assert "building" not in capsys.readouterr().err


def test_the_build_finds_the_ninja_that_pip_installed(monkeypatch):
    """torch's builder runs `ninja` from PATH; python run by its full path may not have pip's on PATH."""
    import shutil

    import ninja

    from tfq.kernels import cpu_build

    monkeypatch.setenv("PATH", "/nowhere")
    assert shutil.which("ninja") is None
    cpu_build._ninja_on_path()
    assert shutil.which("ninja") is not None and ninja.BIN_DIR in shutil.which("ninja")


def _meta_arguments(op) -> list:
    """An op's arguments from its schema, each tensor on the meta device (no memory behind it)."""
    args = []
    for a in op._schema.arguments:
        kind = str(a.type)  # Tensor, Optional[Tensor], List[Tensor], int, float, bool, a class
        if kind.startswith("Optional["):
            args.append(None)
        elif kind == "List[Tensor]":
            args.append([torch.empty(1, device="meta")])
        elif kind == "Tensor":
            args.append(torch.empty(1, device="meta"))
        elif "ExpertBank" in kind:
            args.append(torch.classes.tfq_cpu.ExpertBank([], []))
        else:
            args.append({"int": 1, "float": 1.0, "bool": False}[kind])
    return args


def test_every_cpu_kernel_refuses_a_tensor_off_the_cpu():
    """A kernel given a tensor on another device (a GPU's, here the meta device's) is refused by torch's dispatcher
    with an error naming the op: never run, so no other device's pointer is read (on a GPU machine the CPU linear
    handed CUDA weights crashed the process). Control: the same op on the CPU runs."""
    from tfq.kernels import cpu_build

    ops = cpu_build.ops()
    for name in cpu_build.OPS:
        op = getattr(ops, name).default
        if not any("Tensor" in str(a.type) for a in op._schema.arguments):
            continue  # lanes(): nothing to refuse
        with pytest.raises(NotImplementedError, match=f"tfq_cpu::{name}:? .*Meta"):
            op(*_meta_arguments(op))
    assert cpu_build.op("pack")(torch.ones(64, 8)).shape == (1, 8, 64)
