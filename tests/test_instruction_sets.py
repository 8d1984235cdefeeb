"""tfq's C++ kernels give the same bits on every instruction set: AVX-512 (where this machine has it), AVX2 with
FMA, x86-64's baseline (SSE2, the fused multiply-add computed exactly in doubles) and plain C++ with fmaf (what
ARM runs, with its hardware fma). Each recipe is written over 16 lanes whose every operation rounds once, so the
builds must agree bit for bit (docs/contract.md). Each build here is the same sources compiled for another
-march, run in its own process (the ops share one torch namespace), on the same inputs."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tfq.proofs.case import same_bits

KERNELS = Path(__file__).resolve().parents[1] / "kernels" / "cpu"

RUN = r"""
import sys, torch
from torch.utils import cpp_extension
flags, name, src, out = sys.argv[1:5]
if flags == "tfq":  # tfq's own build, for the -march TFQ_CPU_MARCH names (this CPU's unless set)
    from tfq.kernels import cpu_build
    ops = cpu_build.ops()
else:
    from pathlib import Path
    from tfq.kernels.cpu_build import SOURCES, clear_stale_lock
    clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    cpp_extension.load(name=name, sources=[f"{src}/{s}" for s in SOURCES],
                       extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"] + flags.split(),
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    ops = torch.ops.tfq_cpu
g = torch.Generator().manual_seed(5)
res = {}
D, H, Hkv, R = 64, 14, 2, 700
kc, vc = torch.randn(R, Hkv, D, generator=g), torch.randn(R, Hkv, D, generator=g)
q = torch.randn(40, H, D, generator=g) * 2
table = torch.randperm(R, generator=g)[:600].long()
lengths = torch.tensor([1, 17, 64, 65, 130, 257, 511, 600] + list(range(300, 332))).long()
offsets = torch.zeros(40, dtype=torch.long)
for split in (0, 256):
    res[f"attention, split {split}"] = ops.attend(q, kc, vc, table, offsets, lengths, 0.125, 64, split)
res["attention, bf16 cache"] = ops.attend(q, kc.bfloat16(), vc.bfloat16(), table, offsets, lengths, 0.125, 64, 0)
x = torch.cat([torch.randn(5000, generator=g) * 10, torch.tensor([87.3, -87.3, 89.5, -89.5, 0.0, -0.0])])
res["silu"] = ops.silu(x)
w, xs = torch.randn(300, 896, generator=g), torch.randn(9, 896, generator=g)
res["linear"] = ops.linear(xs, ops.pack(w), torch.randn(300, generator=g), 300)
res["linear, no bias"] = ops.linear(xs, ops.pack(w), None, 300)
res["linear, inputs reversed"] = ops.linear(xs.flip(1).contiguous(), ops.pack(w.flip(1).contiguous()), None, 300)
res["rms norm"] = ops.rms_norm(xs, torch.randn(896, generator=g), 1e-6)
for bits, group, zero, offsets in ((4, 32, 8, False), (5, 32, 16, False), (6, 16, 32, False), (8, 32, 0, False),
                                   (4, 32, 0, True), (5, 32, 0, True)):
    top = 256 if bits == 8 else 2 ** bits
    qi = torch.randint(0, top, (200, 896), generator=g).to(torch.uint8)
    s = torch.randn(200, 896 // group, generator=g) * 0.01
    o = torch.randn(200, 896 // group, generator=g) * 0.01 if offsets else None
    blob = ops.qpack(qi, s, o, bits, group, zero)
    for m in (1, 3, 9):  # registers, and the buffer
        res[f"quantized linear, {bits} bits, {'offsets, ' if offsets else ''}{m} rows"] = ops.qlinear(
            xs[:m].contiguous(), blob, None, 200)
    # activations rounded to 8 bits (quant_q8.cpp): ties in the rounding, a zero block, a NaN, tiles of 1-8 rows
    ties = torch.cat([torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]).repeat(4), torch.zeros(32),
                      torch.randn(832, generator=g)])
    nan = torch.randn(896, generator=g)
    nan[100] = float("nan")
    x8 = torch.cat([ties[None], nan[None], xs]).contiguous()
    blob8 = ops.qpack_q8(qi, s, o, bits, group, zero)
    for m in (1, 5, 11):
        res[f"q8 linear, {bits} bits, {'offsets, ' if offsets else ''}{m} rows"] = ops.qlinear(
            x8[:m].contiguous(), blob8, None, 200)
for bits, rounding in ((4, 1), (4, 2), (6, 2), (8, 2)):  # MLX's groups of 64: the product and the sum rounded
    top = 2 ** bits
    qi = torch.randint(0, top, (200, 896), generator=g).to(torch.uint8)
    zero = 0
    if bits == 8:
        qi, zero = (qi.to(torch.int16) - 128).to(torch.int8).view(torch.uint8), -128
    s = (torch.rand(200, 14, generator=g) * 0.02).bfloat16().float()
    o = (torch.randn(200, 14, generator=g) * 0.05).bfloat16().float()
    blob = ops.qpack(qi, s, o, bits, 64, zero, rounding)
    for m in (1, 5, 9):
        res[f"MLX groups, {bits} bits, rounding {rounding}, {m} rows"] = ops.qlinear(
            xs[:m].contiguous(), blob, None, 200)
# a hybrid's DeltaNet: head dims with and without a tail past the 16 lanes, fresh and carried state, a save
for kh, kd, vh, vd in ((2, 32, 6, 32), (1, 24, 3, 40)):
    C = 2 * kh * kd + vh * vd
    xd = torch.randn(23, C, generator=g)
    a, b = torch.randn(23, vh, generator=g), torch.randn(23, vh, generator=g)
    conv_w, A, dt = (torch.randn(4, C, generator=g) * 0.5, -torch.randn(vh, generator=g).exp(),
                     torch.randn(vh, generator=g))
    cs, rs = torch.randn(3, 3, C, generator=g), torch.randn(3, vh, kd, vd, generator=g) * 0.1
    sc, sr = torch.zeros(3, 3, C), torch.zeros(3, vh, kd, vd)
    seg = torch.tensor([[0, 13, 0, 1, 0], [13, 5, 1, 0, 1], [18, 5, 2, 0, 0]])
    o = ops.deltanet(xd, a, b, conv_w, A, dt, cs, rs, seg, sc, sr, kh, kd, vh, vd)
    res[f"deltanet {kd}/{vd}"], res[f"deltanet {kd}/{vd} state"] = o, torch.cat([cs.flatten(), rs.flatten()])
    res[f"deltanet {kd}/{vd} saved"] = torch.cat([sc.flatten(), sr.flatten()])
    z = torch.randn(23 * vh, vd, generator=g)
    res[f"gated rms norm {vd}"] = ops.gated_rms_norm(o.reshape(23 * vh, vd), torch.randn(vd, generator=g), z, 1e-6)
res["sigmoid gate"] = ops.sigmoid_gate(x, torch.randn(x.shape, generator=g) * 10)
# a mixture of experts: routes (ties among the rounded logits), then the experts and the combine
logits = torch.cat([3 * torch.randn(64, 128, generator=g), torch.randn(16, 128, generator=g).round()])
res["moe routes"], res["moe weights"], res["moe rows unsure"] = ops.moe_route(logits, 8, True)
gate_ups = [ops.pack(torch.randn(64, 96, generator=g)) for _ in range(6)]
downs = [ops.pack(torch.randn(96, 32, generator=g)) for _ in range(6)]
res["moe mixture"] = ops.moe_mixture(torch.randn(10, 96, generator=g), torch.randint(0, 6, (10, 3), generator=g),
                                     torch.rand(10, 3, generator=g), torch.classes.tfq_cpu.ExpertBank(gate_ups, downs),
                                     32, None)
# fma where rounding twice goes wrong: a * b a float midpoint (1 + 2^-11 + 2^-24), c far below a double's ulp of it,
# so only a fused operation sees which side; then specials (zeros, infinities, NaN, subnormals, overflow), random
near = 1 + 2.0 ** -12
a = torch.tensor([near, -near, near, -near] * 40 + [0.0, -0.0, float("inf"), float("nan"), 1e-30, 3e38, 1.0, -2.0])
b = torch.tensor([near] * 160 + [-0.0, 0.0, 0.0, 1.0, 1e-15, 3.0, float("inf"), float("-inf")])
tiny = [2.0 ** -k for k in range(60, 100)]
c = torch.tensor([t * s for t in tiny for s in (1, 1, -1, -1)] + [0.0, -0.0, 1.0, 2.0, 1e-40, -3e38, -1.0, 5.0])
res["fma, hazards"] = ops.fma(a, b, c)
a, b, c = (torch.randn(4099, generator=g) * 2.0 ** torch.randint(-60, 60, (4099,), generator=g) for _ in range(3))
res["fma, random"] = ops.fma(a, b, c)
torch.save(res, out)
"""


# name -> (TFQ_CPU_MARCH of tfq's own build, or the flags of a build of the tests' own)
BUILDS = {"tfq": ("native", "tfq"), "haswell": ("haswell", "tfq"), "x86-64": ("x86-64", "tfq"),
          "plain": (None, "-march=x86-64 -DTFQ_PLAIN_LANES")}


def _outputs(build: tuple[str | None, str], tmp_path: Path) -> dict:
    march, flags = build
    h = hashlib.sha256(flags.encode())
    for f in sorted(KERNELS.iterdir()):
        h.update(f.read_bytes())
    name = f"tfq_isa_{h.hexdigest()[:16]}"
    out = tmp_path / f"{march or name}.pt"
    env = {**os.environ, "TFQ_CPU_MARCH": march or "native"}
    done = subprocess.run([sys.executable, "-c", RUN, flags, name, str(KERNELS), str(out)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("isa")
    return {name: _outputs(build, tmp) for name, build in BUILDS.items()}


@pytest.mark.parametrize("march", ["haswell", "x86-64", "plain"])
def test_every_kernel_has_the_same_bits_on_every_instruction_set(builds, march):
    """The engine's build (-march=native) against AVX2 + FMA (haswell), the x86-64 baseline (SSE2, the fused
    multiply-adds emulated in doubles) and plain C++ lanes (every fused multiply-add fmaf, as on ARM): every
    output equal bit for bit."""
    native, other = builds["tfq"], builds[march]
    assert [k for k in native if not same_bits(native[k], other[k])] == []
    assert any(torch.isnan(t).any() for t in native.values())  # NaN cases: compared by their bits (torch.equal
    # calls no NaN equal, not even to itself)


def test_control_rounding_twice_parts_from_fma(builds):
    """The fma hazards are sharp: a * b rounded first, then + c (the two roundings an emulation in doubles would
    make without rounding to odd), parts from every build's fma."""
    ops_out = builds["tfq"]["fma, hazards"][:160]
    near = torch.tensor(1 + 2.0 ** -12, dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0, -1.0] * 40, dtype=torch.float64) * near
    tiny = torch.tensor([2.0 ** -k * s for k in range(60, 100) for s in (1, 1, -1, -1)], dtype=torch.float64)
    twice = (a * near + tiny).float()  # the product is exact in doubles; the sum rounds, then the float
    assert not same_bits(ops_out, twice)


def test_control_the_comparison_sees_one_sum_in_another_order(builds):
    """The comparison above is sharp enough to see a change of order alone: the same products summed from the
    last input to the first (inputs and weights reversed) part from the kernel's bits."""
    native = builds["tfq"]
    assert not same_bits(native["linear, no bias"], native["linear, inputs reversed"])
    assert (native["linear, no bias"] - native["linear, inputs reversed"]).abs().max() < 1e-3  # same sums


def test_a_killed_builds_lock_is_cleared_and_a_live_ones_kept(tmp_path):
    """torch's builder waits forever on the lock a killed build left; tfq removes a lock older than a build can
    take, and keeps a fresh one (another process building now). By construction: two lock files of given ages."""
    import time

    from tfq.kernels.cpu_build import STALE_LOCK_S, clear_stale_lock

    old, live = tmp_path / "old", tmp_path / "live"
    for folder, age in ((old, STALE_LOCK_S + 60), (live, 5)):
        folder.mkdir()
        (folder / "lock").write_text("")
        os.utime(folder / "lock", (time.time() - age,) * 2)
        clear_stale_lock(folder)
    assert not (old / "lock").exists() and (live / "lock").exists()
