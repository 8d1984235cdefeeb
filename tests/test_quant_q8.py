"""weights: gguf-q8. A GGUF's quantized matrices kept in their blocks, with the activations rounded to 8 bits per
block of 32 and summed in integers (kernels/cpu/quant_q8.cpp): every format gives the bits of the recipe written
in torch (tfq.kernels.quant_q8.reference) at every row count (thread counts: tests/test_quant.py), and a model
on them is exact by tfq's rule (together, paged, chunked, preempted: the bits of each stream alone)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cli import tfq
from engines import alone, bits, run, run_on
from test_quant import CROWDED, ROWS, mixed_requests, random_blocks, tiny_file  # noqa: F401
from tfq.kernels import cpu_build
from tfq.kernels.quant import FORMATS, QuantLinear, format_bytes, from_blocks, join
from tfq.kernels.quant_q8 import reference, round_activations
from tiny import held_bytes

pytestmark = pytest.mark.skipif(not cpu_build.load()[0], reason="tfq's CPU kernels do not build here")


@pytest.fixture(scope="module", params=FORMATS)
def q8(request):
    kind, n, k = request.param, 200, 512
    return from_blocks(kind, random_blocks(kind, n, k, seed=40 + FORMATS.index(kind)), (n, k)).with_activations("q8")


def awkward_rows(m: int, k: int) -> torch.Tensor:
    """Random rows, with a block of ties in the rounding (amax 127: inv is 1), a zero block and a tiny one."""
    x = torch.randn(m, k)
    x[0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    x[0, 8:32] = 0.25
    x[1, 32:64] = 0.0
    x[2, 64:96] = 1e-35
    return x


@pytest.mark.parametrize("bias", [False, True])
def test_q8_layer_is_the_recipe_at_every_row_count(q8, bias):
    b = torch.randn(q8.shape[0]) if bias else None
    f = QuantLinear(q8, b)
    x = awkward_rows(max(ROWS), q8.shape[1])
    full = f(x)
    assert torch.equal(full, reference(x, q8, b)), q8.kind
    for m in ROWS:  # tiles of up to 8 rows (4 on AVX2) and their remainders
        assert torch.equal(f(x[:m]), full[:m]), (q8.kind, m)
    assert torch.equal(f(x.flip(0)), full.flip(0)), q8.kind


def test_offsets_beside_a_zero_take_their_own_tile():
    """GGUF's formats with offsets have zero 0, and their tiles leave the zero out; a blob with both (MLX's 8 bits
    keep zero -128) takes the tiles that count it. Q4_K's blocks with zero 8 and -128: the recipe, at every row
    count, and not the bits of zero 0 (the control: a tile that dropped the zero would give those)."""
    base = from_blocks("Q4_K", random_blocks("Q4_K", 48, 512, seed=7), (48, 512)).with_activations("q8")
    x = awkward_rows(max(ROWS), 512)
    plain = QuantLinear(base, None)(x)
    for zero in (8, -128):
        w = dataclasses.replace(base, zero=zero)
        full = QuantLinear(w, None)(x)
        assert torch.equal(full, reference(x, w, None)) and not torch.equal(full, plain), zero
        for m in ROWS:
            assert torch.equal(QuantLinear(w, None)(x[:m]), full[:m]), (zero, m)


def test_the_prefetch_pair_is_set_and_restored_and_the_bits_stay(q8):
    """The prefetch distances differ by CPU (kernels/cpu/quant_q8.cpp): q8_prefetch sets a pair and reads it back,
    refuses half a pair or a negative one, and the same rows give the recipe's bits at any pair, from (0, 0) (the
    current line) to one that reaches past the weights' end."""
    f = QuantLinear(q8)
    x = awkward_rows(9, q8.shape[1])
    own = tuple(cpu_build.op("q8_prefetch")())
    try:
        outs = []
        for pair in [(0, 0), (64, 128), (384, 2048), (4096, 8192), (1 << 20, 1 << 21)]:
            assert tuple(cpu_build.op("q8_prefetch")(*pair)) == pair
            outs.append(f(x))
        for bad in [(-1, 2048), (384, -5)]:
            with pytest.raises(RuntimeError, match="two distances in bytes"):
                cpu_build.op("q8_prefetch")(*bad)
            assert tuple(cpu_build.op("q8_prefetch")()) == pair  # a refused pair changes nothing
    finally:
        cpu_build.op("q8_prefetch")(*own)
    assert tuple(cpu_build.op("q8_prefetch")()) == own
    assert all(torch.equal(o, outs[0]) for o in outs) and torch.equal(outs[0], reference(x, q8)), q8.kind


@pytest.mark.parametrize("kinds, i", [(("Q4_K", "Q4_K"), 96), (("Q8_0", "Q6_K"), 96), (("Q4_K", "Q5_0"), 16 * 37)])
def test_silu_times_up_in_the_gate_up_kernel_has_the_bits_of_the_layer_then_silu(kinds, i):
    """q8's linear_glu (a layer's MLP in one call takes it): silu(gate) * up from a gate_up blob in one kernel, the
    bits of the gate_up layer, then tfq's SiLU and torch's product, at every row count and with the gate and the
    up of different formats, in runs of one panel and of two with a shorter last one (37 panels a half); a blob
    whose halves are not whole panels of 16 is refused with one line. The control: the same blob read as up then
    gate parts from it."""
    from tfq.kernels.rowwise import silu_fixed

    glu, k = cpu_build.op("qlinear_glu"), 256
    gate, up = (from_blocks(kind, random_blocks(kind, i, k, seed=50 + n), (i, k)).with_activations("q8")
                for n, kind in enumerate(kinds))
    f = QuantLinear(join([gate, up]))
    x = awkward_rows(max(ROWS), k)
    for m in ROWS:
        gu = f(x[:m])
        want = silu_fixed(gu[:, :i]) * gu[:, i:]
        assert torch.equal(glu(x[:m], f.panels, i), want), (kinds, m)
        assert not torch.equal(silu_fixed(gu[:, i:]) * gu[:, :i], want), (kinds, m)  # control
    odd = QuantLinear(from_blocks("Q8_0", random_blocks("Q8_0", 200, k, seed=3), (200, k)).with_activations("q8"))
    with pytest.raises(RuntimeError, match="whole panels of 16"):
        glu(x[:2], odd.panels, 100)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_layer_in_runs_that_shrink_has_every_panel_once(restored_threads, threads):
    """A layer of 700 panels (and a gate_up of 350 pairs): threads claim runs of up to 32 panels (21 pairs) that
    shrink to one as the layer ends (kernels/cpu/claims.h). At 1, 2 and 3 threads every output is the recipe's;
    a panel no thread took, or one taken twice into the glu's buffers, would give other bits. The control: one up
    panel changed."""
    from tfq.kernels.rowwise import silu_fixed

    torch.set_num_threads(threads)
    n, k = 16 * 700, 64
    q = from_blocks("Q8_0", random_blocks("Q8_0", n, k, seed=60), (n, k)).with_activations("q8")
    f = QuantLinear(q)
    x = awkward_rows(3, k)
    want = reference(x, q)
    assert torch.equal(f(x), want)
    assert torch.equal(f(x[:1]), want[:1])
    glu = cpu_build.op("qlinear_glu")(x, f.panels, n // 2)
    assert torch.equal(glu, silu_fixed(want[:, :n // 2]) * want[:, n // 2:])
    changed = want.clone()
    changed[:, -16:] += 1
    assert not torch.equal(glu, silu_fixed(changed[:, :n // 2]) * changed[:, n // 2:])  # control


def test_the_rounding_of_the_activations():
    """Ties go to even, a zero or tiny block is zero, a NaN makes its block's scale NaN."""
    x = torch.zeros(1, 96)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
    x[0, 32] = 1e-35
    x[0, 64], x[0, 65] = float("nan"), 1.0
    q, d = round_activations(x)
    assert q[0, :4].tolist() == [127, 0, 2, -2] and d[0, 0].item() == 1.0
    assert d[0, 1].item() == 0.0 and not q[0, 32:64].any()
    assert torch.isnan(d[0, 2]) and not q[0, 64:].any()
    y = QuantLinear(from_blocks("Q8_0", random_blocks("Q8_0", 16, 96, seed=3), (16, 96)).with_activations("q8"))(x)
    assert torch.isnan(y).all()  # the NaN reaches every output, as in fp32


def test_control_the_comparison_sees_one_integer_of_the_weights_changed(q8):
    """RED by construction: with a one-hot row, output 3 is d s (q[3, 5] - zero) 127 (+ the offset's term), so
    the reference on weights whose q[3, 5] differs by one must part from the kernel."""
    one_hot = torch.zeros(2, q8.shape[1])
    one_hot[0, 5] = 1.0
    nudged = q8.with_activations("q8")
    nudged.q = q8.q.clone()
    nudged.q[3, 5] ^= 1
    got = QuantLinear(q8)(one_hot)
    assert torch.equal(got, reference(one_hot, q8)) and not torch.equal(got, reference(one_hot, nudged))


def test_q8_is_another_arithmetic_than_gguf(q8):
    """Not fp32 activations: the same blocks give other bits (and the float64 product within a few per cent)."""
    x = torch.randn(4, q8.shape[1])
    fp32, rounded = QuantLinear(q8.with_activations("fp32"))(x), QuantLinear(q8)(x)
    assert not torch.equal(fp32, rounded)
    assert ((rounded - fp32).abs().max() / fp32.abs().max()).item() < 0.05


def test_joined_formats_and_the_plans_count(q8):
    """A layer of three formats is one blob of q8 segments, equal to each part alone; a matrix's blob is the
    plan's count (format_bytes)."""
    assert QuantLinear(q8).panels.numel() == q8.nbytes() == format_bytes(q8.kind, *q8.shape, "q8")
    other = from_blocks("Q6_K", random_blocks("Q6_K", 48, 512, seed=2), (48, 512)).with_activations("q8")
    joined = QuantLinear(join([q8, other]))
    x = torch.randn(5, 512)
    assert torch.equal(joined(x), torch.cat([QuantLinear(q8)(x), QuantLinear(other)(x)], 1))


def test_one_blob_holds_one_layout():
    from tfq.kernels.quant import pack

    a = from_blocks("Q4_K", random_blocks("Q4_K", 16, 256, seed=1), (16, 256))
    with pytest.raises(RuntimeError, match="share their inputs and their layout"):
        cpu_build.op("qlinear")(torch.randn(1, 256), cpu_build.op("qcat")([pack(a), pack(a.with_activations("q8"))]),
                                None, 32)


# -- through the model and the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_file):  # noqa: F811
    from tfq.model.load import load_model

    return {w: load_model(str(tiny_file), progress=False, weights=w) for w in ("gguf", "gguf-q8")}


def test_the_model_keeps_q8_layers_and_the_plan_counts_them(loaded, tiny_file):  # noqa: F811
    from tfq.kernels.layer import fusable
    from tfq.model.gguf_header import read_header
    from tfq.model.gguf_kept import kept_summary

    model = loaded["gguf-q8"].model
    layer = model.layers[0]
    magic = lambda f: bytes(f.panels[:4].tolist())  # noqa: E731
    assert {magic(f) for f in (layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head)} == {b"TFQ8"}
    assert magic(loaded["gguf"].model.layers[0].qkv) == b"TFQ2"
    assert fusable(layer.qkv, layer.o, layer.gate_up, layer.down) and model.runs_in_one_call(layer)
    assert held_bytes(model) == kept_summary(read_header(tiny_file), "q8").resident  # (gguf's, where N % 64 == 0)


def test_engine_streams_on_q8_equal_their_runs_alone(loaded):
    """Greedy and sampled streams, chunked prompts, paged, preempted: each stream's ids and logits digests on
    gguf-q8 equal its run alone. The control: the same requests on gguf give other digests."""
    requests = mixed_requests(loaded["gguf"].config.vocab_size, seed=1)
    q8 = loaded["gguf-q8"].model
    together, engine = run_on(q8, requests, **CROWDED)
    assert engine.scheduler.preemptions > 0
    assert bits(together) == bits(alone(q8, requests, lanes=4))
    assert [r.digests for r in together] != [r.digests for r in run(loaded["gguf"].model, requests, lanes=4)]


def test_plan_says_what_gguf_q8_computes(tiny_file, monkeypatch, capsys):  # noqa: F811
    code, out, _ = tfq(["plan", "--model", str(tiny_file), "--set", "weights=gguf-q8"], monkeypatch, capsys)
    assert code == 0
    assert "weights: gguf-q8 (set by --set): the file's quantized blocks" in out
    assert "rounded to 8 bits per block of 32" in out
