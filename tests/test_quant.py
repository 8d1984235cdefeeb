"""weights: gguf. A GGUF's quantized matrices kept in their blocks (tfq/kernels/quant.py, kernels/cpu/quant.cpp)
give every row the bits the fp32 layer gives on the dequantized weights: for every format, at every row count
and order, at 1, 2, 3, 4 and 8 threads, in the one-call layer and through the engine; the controls show the
comparisons can fail."""
from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from engines import alone, bits, run, run_on
from tfq.errors import TfqError
from tfq.kernels import cpu_build
from tfq.kernels.quant import FORMATS, KEPT, QuantLinear, Stacked, format_bytes, from_blocks, join
from tfq.kernels.rowwise import FixedOrderLinear
from tfq.model.gguf_kept import BlockRows
from tfq.proofs.kernel_check_rowwise import dequantized, linear_bound
from tfq.proofs.kernel_check_rowwise import random_blocks as check_blocks
from tiny import held_bytes, resident_bytes, write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_build.load()[0], reason="tfq's CPU kernels do not build here")

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70, 96, 97, 130)
THREADS = (1, 2, 3, 4, 8)


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    return check_blocks(kind, n, k, np.random.default_rng(seed))


@pytest.fixture(scope="module", params=FORMATS)
def layer(request):
    """(kind, Quantized, the gguf package's dequantized weights) for a 200 x 512 matrix."""
    kind, n, k = request.param, 200, 512
    raw = random_blocks(kind, n, k, seed=FORMATS.index(kind))
    return kind, from_blocks(kind, raw, (n, k)), dequantized(kind, raw, n, k)


def test_every_format_unpacks_to_the_gguf_packages_values(layer):
    kind, q, ref = layer
    assert torch.equal(q.dequantized().view(torch.int32), ref.view(torch.int32)), kind
    # and the kernel's own unpacking: the identity through the layer gives W^T (a zero's sign aside: +0)
    assert torch.equal(QuantLinear(q)(torch.eye(q.shape[1])).T, ref + 0.0), kind


@pytest.mark.parametrize("bias", [False, True])
def test_quantized_layer_gives_the_fp32_layers_bits_at_every_row_count(layer, bias):
    kind, q, ref = layer
    b = torch.randn(q.shape[0]) if bias else None
    quant, fp32 = QuantLinear(q, b), FixedOrderLinear(ref, b)
    x = torch.randn(max(ROWS), q.shape[1])
    full = quant(x)
    assert torch.equal(full, fp32(x)), kind
    for m in ROWS:  # fewer rows (registers up to 8, L1 blocks up to 96, a whole panel beyond), the rows reversed
        assert torch.equal(quant(x[:m]), full[:m]), (kind, m)
    assert torch.equal(quant(x.flip(0)), full.flip(0)), kind


def test_float64_bound_against_the_dequantized_weights(layer):
    kind, q, ref = layer
    x = torch.randn(9, q.shape[1])
    err = (QuantLinear(q)(x).double() - x.double() @ ref.double().T).abs()
    assert (err <= linear_bound(x, ref)).all(), kind


@pytest.mark.parametrize("activations", ["fp32", "q8"])  # weights: gguf, and gguf-q8 (tests/test_quant_q8.py)
def test_row_bits_do_not_move_with_the_thread_count(restored_threads, activations):
    """Every format, rows alone and among others, at 1, 2, 3, 4 and 8 threads: the bits of 1 thread."""
    for kind in FORMATS:
        n, k = 300, 768
        q = from_blocks(kind, random_blocks(kind, n, k, seed=7), (n, k)).with_activations(activations)
        f = QuantLinear(q, torch.randn(n))
        x = torch.randn(12, k)
        torch.set_num_threads(1)
        want = f(x)
        for t in THREADS:
            torch.set_num_threads(t)
            assert torch.equal(f(x), want), (kind, t)
            assert torch.equal(f(x[5:6]), want[5:6]), (kind, t)
            assert torch.equal(f(x[:3]), want[:3]), (kind, t)


def test_joining_formats_keeps_each_at_its_width():
    """q (Q5_0), k (Q4_K), v (Q6_K), as the qkv layer joins them: one blob of three segments, each in its own
    format and at its own size, whose layer equals the fp32 layer on the three matrices stacked."""
    parts, values = [], []
    for i, kind in enumerate(("Q5_0", "Q4_K", "Q6_K")):
        raw = random_blocks(kind, 64 + 32 * i, 512, seed=20 + i)
        parts.append(from_blocks(kind, raw, (64 + 32 * i, 512)))
        values.append(dequantized(kind, raw, 64 + 32 * i, 512))
    joined = join(parts)
    assert isinstance(joined, Stacked) and [p.kind for p in joined.parts] == ["Q5_0", "Q4_K", "Q6_K"]
    stacked = torch.cat(values)
    assert torch.equal(joined.dequantized(), stacked)
    x = torch.randn(10, 512)
    layer = QuantLinear(joined)
    assert layer.panels.numel() == sum(QuantLinear(p).panels.numel() for p in parts)
    for m in (1, 3, 8, 10):  # registers and the buffer, across the segments' boundaries
        assert torch.equal(layer(x[:m]), FixedOrderLinear(stacked)(x[:m])), m


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_formats_keep_the_files_two_levels_of_scales(kind):
    """A K format's blob holds the super block's fp32 scale and an int8 one per group (the file's levels), not an
    fp32 scale per group: 4.75 bits a Q4_K weight (the file: 4.5), 6.625 a Q6_K one. The control: scales that
    do not multiply to s are refused when packing."""
    n, k = 128, 512
    q = from_blocks(kind, random_blocks(kind, n, k, seed=5), (n, k))
    bits, group, offsets = KEPT[kind]
    blob = QuantLinear(q).panels.numel()
    assert blob == 64 + n * k * bits // 8 + n * (k // group) * (1 + offsets) + 4 * n * (k // 256) * (1 + offsets)
    assert blob == q.nbytes()
    wrong = dataclasses.replace(q, levels=dataclasses.replace(q.levels, sub=q.levels.sub.roll(1, 1)))
    with pytest.raises(RuntimeError, match="two-level scales"):
        QuantLinear(wrong)


def test_control_the_bit_comparison_sees_one_weight_one_ulp_off():
    """The equality with the fp32 layer is sharp: the same weights with one of them moved by one ulp give
    other bits. By construction: row 0 is the one-hot input of that weight, so its output is the weight itself."""
    raw = random_blocks("Q6_K", 64, 256, seed=3)
    q, ref = from_blocks("Q6_K", raw, (64, 256)), dequantized("Q6_K", raw, 64, 256)
    nudged = ref.clone()
    nudged[5, 17] = torch.nextafter(nudged[5, 17], torch.tensor(1.0))
    x = torch.randn(4, 256)
    x[0] = 0.0
    x[0, 17] = 1.0
    assert torch.equal(QuantLinear(q)(x), FixedOrderLinear(ref)(x))
    assert not torch.equal(QuantLinear(q)(x), FixedOrderLinear(nudged)(x))


@pytest.mark.parametrize("kind", FORMATS)
def test_the_plans_count_of_a_matrix_is_its_blob(kind):
    """format_bytes (what `tfq plan` counts from a file's header) is the packed blob's size, a partial panel too."""
    n, k = 200, 512
    q = from_blocks(kind, random_blocks(kind, n, k, seed=6), (n, k))
    assert QuantLinear(q).panels.numel() == format_bytes(kind, n, k) == q.nbytes(), kind


def test_the_blob_is_the_files_size():
    """A 5-bit weight costs 5 bits plus its group's fp32 scale (6 bits; the file: 5.5 with fp16 scales)."""
    raw = random_blocks("Q5_0", 128, 1024, seed=4)
    f = QuantLinear(from_blocks("Q5_0", raw, (128, 1024)))
    assert f.panels.numel() == 64 + 128 * 1024 * 6 // 8


def test_small_kept_blobs_lie_side_by_side_in_blocks_freed_with_their_last_blob():
    """A blob under 2 MiB that a layer keeps (a mixture's expert) is carved from a block of 2 MiB pages shared with
    the blobs kept before and after it (kernels/cpu/memory.h), 64-byte aligned; a block is freed with its last
    blob. A lone blob of 2 MiB or more keeps its own pages: qcat hands it back as it is."""
    blob = QuantLinear(from_blocks("Q4_K", random_blocks("Q4_K", 1024, 1024, seed=8), (1024, 1024))).panels
    qcat, blocks = cpu_build.op("qcat"), cpu_build.op("lasting_blocks")
    step = -(-blob.numel() // 64) * 64
    gc.collect()  # blobs of earlier tests held only in cycles go now, not while the blocks are counted
    before = blocks()
    kept = [qcat([blob]) for _ in range(120)]  # 68 MB: at least two blocks of their own
    starts = [k.data_ptr() for k in kept]
    assert all(start % 64 == 0 for start in starts) and all(torch.equal(k, blob) for k in kept)
    assert sum(b - a == step for a, b in zip(starts, starts[1:])) >= 110  # a new block only a few times
    assert blocks() >= before + 2
    last = kept.pop()
    del kept
    assert blocks() == before + 1  # the blocks only the others held are gone; the last blob's stays
    del last
    assert blocks() == before
    big = QuantLinear(from_blocks("Q8_0", random_blocks("Q8_0", 2048, 1024, seed=9), (2048, 1024))).panels
    assert big.numel() >= 2 << 20 and qcat([big]).data_ptr() == big.data_ptr()


# -- through the model and the engine, on a tiny GGUF with the default model's types ------------------------

@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("quant") / "tiny-like-default.gguf", "qwen2", like_default=True,
                           layers=2, intermediate=512, seed=4)


@pytest.fixture(scope="module")
def loaded(tiny_file):
    from tfq.model.load import load_model

    return {w: load_model(str(tiny_file), progress=False, weights=w) for w in ("fp32", "gguf")}


def test_the_model_keeps_each_matrix_in_its_format(loaded):
    model = loaded["gguf"].model
    layer0, layer1 = model.layers[:2]
    assert isinstance(model.embed, BlockRows) and model.embed.kind == "Q5_0"  # left on the mapped file
    ids = torch.tensor([0, 7, 3, 7])
    assert torch.equal(model.embed.rows(ids), loaded["fp32"].model.embed[ids])  # its rows: the fp32 model's bits
    assert (layer0.qkv.kind, layer1.qkv.kind) == ("mixed", "Q5_0")  # v in Q8_0 in even layers: its own segment
    assert (layer0.down.kind, layer1.down.kind) == ("Q6_K", "Q4_K")
    assert model.lm_head.kind == "Q8_0" and layer0.gate_up.kind == "Q5_0"
    assert loaded["gguf"].weights == "gguf" and loaded["fp32"].weights == "fp32"


def test_the_embedding_keeps_recent_rows_with_the_values_of_its_blocks(loaded, monkeypatch):
    """A decode step's rows come from the rows looked up before, kept unpacked and bounded: every lookup, new or
    seen again, has the fp32 model's bits. The control: a kept row changed on purpose is what a lookup returns."""
    embed, fp32 = loaded["gguf"].model.embed, loaded["fp32"].model.embed
    monkeypatch.setattr(embed, "most_kept", 3)
    embed.kept.clear()
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        ids = torch.randint(0, 12, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        assert torch.equal(embed.rows(ids), fp32[ids]) and len(embed.kept) <= 3
    assert torch.equal(embed.rows(torch.arange(20)), fp32[:20])  # a prompt's many rows: unpacked whole
    token = next(iter(embed.kept))
    embed.kept[token] = embed.kept[token] + 1
    assert not torch.equal(embed.rows(torch.tensor([token])), fp32[[token]])
    embed.kept.clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_embedding_rows_are_read_from_the_file_not_its_mapping(loaded, tiny_file):
    """Looked-up rows come through pread: the file's pages stay in the page cache, none become this process's
    (on the mapping, each row read would map the 64 KiB about it). The control: the same rows read on the
    mapping are resident."""
    embed, fp32 = loaded["gguf"].model.embed, loaded["fp32"].model.embed
    embed.kept.clear()
    embed._data.release(embed._t)  # the table's mapped pages let go, whatever ran before
    before = resident_bytes(path=tiny_file)
    ids = torch.arange(embed.shape[0])
    assert torch.equal(embed.rows(ids), fp32) and torch.equal(embed.rows(ids[:3]), fp32[:3])
    assert resident_bytes(path=tiny_file) == before
    assert int(embed.raw[ids.numpy()].sum()) > 0 and resident_bytes(path=tiny_file) > before
    embed.kept.clear()


def test_a_token_outside_the_vocabulary_is_refused_alone(loaded):
    """The table's rows are read from the file by offset, where a row past its end would be another tensor's
    bytes: a lookup outside it raises, and a prompt with such a token fails at once, in one line, while the
    request beside it gets its bits alone."""
    from tfq.engine.stream import Request

    model = loaded["gguf"].model
    rows = model.embed.shape[0]
    for outside in ([rows], [-1], [3, rows + 7]):
        with pytest.raises(IndexError):
            model.embed.rows(torch.tensor(outside))
    good = Request(prompt=(5, 9, 2, 7), max_tokens=6)
    bad, beside = run(model, [Request(prompt=(5, rows, 2), max_tokens=6), good])
    assert bad.error == f"request: prompt token {rows} at position 1 is not an id of the model's vocabulary; give " \
                        f"ids in [0, {loaded['gguf'].config.vocab_size})" and not bad.ids
    assert not beside.error and bits([beside]) == bits(alone(model, [good]))

def test_the_plan_counts_the_bytes_the_model_keeps(loaded, tiny_file):
    """The plan's weights (kept_summary, from the header alone) are the bytes the loaded model holds: every
    layer's blob, the fp32 norms and biases, the embedding's blocks on the file. The control: the fp32 model
    holds other bytes."""
    from tfq.model.gguf_header import read_header
    from tfq.model.gguf_kept import kept_summary

    assert held_bytes(loaded["gguf"].model) == kept_summary(read_header(tiny_file)).resident
    assert held_bytes(loaded["fp32"].model) != kept_summary(read_header(tiny_file)).resident


def mixed_requests(vocab: int, seed: int) -> list:
    """Greedy and sampled requests of several lengths, one longer than a 64-row chunk and the 6-page pool."""
    from tfq.engine.stream import Request

    g = torch.Generator().manual_seed(seed)
    return [Request(prompt=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()), max_tokens=t,
                    temperature=temp, seed=i) for i, (n, t, temp) in
            enumerate([(120, 20, 0.0), (121, 20, 0.8), (125, 16, 0.0), (5, 9, 0.0), (300, 4, 0.0)])]


CROWDED = dict(lanes=4, prefill_chunk=64, page_rows=64, pool_pages=6)  # chunked prompts on 6 pages: preempted


def test_engine_streams_on_gguf_weights_equal_fp32_and_their_runs_alone(loaded):
    """Greedy and sampled streams, chunked prompts, paged and contiguous: on gguf weights each stream's ids and
    logits digests equal its run alone and equal the fp32 weights' run (the same file, dequantized)."""
    requests = mixed_requests(loaded["gguf"].config.vocab_size, seed=0)
    gguf, fp32 = loaded["gguf"].model, loaded["fp32"].model
    together, engine = run_on(gguf, requests, **CROWDED)
    assert engine.scheduler.preemptions > 0  # the 6-page pool cannot hold them all: streams were preempted
    assert bits(together) == bits(run(fp32, requests, **CROWDED))
    assert bits(together) == bits(alone(gguf, requests, lanes=4))


def test_the_one_call_layer_runs_quantized_layers(loaded):
    from tfq.kernels.layer import fusable

    layer = loaded["gguf"].model.layers[0]
    assert fusable(layer.qkv, layer.o, layer.gate_up, layer.down)
    assert loaded["gguf"].model.runs_in_one_call(layer)


def test_weights_auto_is_gguf_q8_for_a_gguf_file_and_fp32_for_a_folder(tiny_file, tiny_dirs):
    from tfq.model.footprint import weights_kind

    assert weights_kind("auto", str(tiny_file))[0] == "gguf-q8"  # the faster exact arithmetic (footprint.py)
    assert weights_kind("auto", str(tiny_dirs["qwen2"]))[0] == "fp32"
    assert weights_kind("auto", str(tiny_file), "cuda")[0] == "fp32"
    assert weights_kind("fp32", str(tiny_file))[0] == "fp32"


def test_gguf_weights_on_an_hf_folder_is_one_line(tiny_dirs):
    from tfq.model.load import load_model

    with pytest.raises(TfqError, match="weights: gguf keeps a GGUF file's quantized blocks.*HF folder"):
        load_model(str(tiny_dirs["qwen2"]), progress=False, weights="gguf")


def test_cli_bad_weights_value_exits_2(tiny_file):
    done = subprocess.run([sys.executable, "-m", "tfq", "plan", "--model", str(tiny_file), "--set", "weights=int3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "weights must be one of auto | fp32 | gguf | gguf-q8" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_default_model_gguf_equals_fp32(default_model):
    """The default model on its own blocks with fp32 sums (weights: gguf) against the same file dequantized to
    fp32: every prompt row's logits equal, bit for bit, for three chats prefilled together. (The shared fixture,
    weights: auto, computes in gguf-q8, another arithmetic: its bits differ, as test_quant_q8.py shows.)"""
    from tfq.engine.stream import Request
    from tfq.model.load import load_model

    assert default_model.weights == "gguf-q8"
    gguf = load_model("default", progress=False, weights="gguf")
    fp32 = load_model("default", progress=False, weights="fp32")
    tok = default_model.tokenizer
    prompts = [tok.chat_ids([{"role": "user", "content": c}]) for c in
               ("Write a Python function that checks whether a number is prime.", "What is 17 * 23?",
                "Explain what a mutex is in two sentences.")]

    def scored(loaded):
        requests = [Request(prompt=tuple(p), max_tokens=12, prompt_logprobs=0) for p in prompts]
        return [(r.ids, r.digests, [p.logprob for p in r.prompt_logprobs[1:]]) for r in
                run(loaded.model, requests, window=256, lanes=3)]

    assert scored(gguf) == scored(fp32)
