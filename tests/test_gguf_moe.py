"""Mixtures of experts as GGUF files (qwen3moe, qwen35moe), written by llama.cpp's own converter from random
transformers models of the real ratios: each layer's stacked experts read as one matrix an expert, the F32 file
computes as its HF folder does bit for bit, the Q8_0 file's experts stay in their blocks with the bits of their
values, and `tfq together` on the Q8_0 file: every arm EXACT, the controls RED."""
from __future__ import annotations

import json

import pytest

from cli import tfq
from engines import bits, run
from test_gguf_hybrid import converter, kept_blocks_have_their_values_bits  # noqa: F401 - converter: a fixture
from test_hybrid import requests, shipped_hybrid_suite
from test_moe import HYBRID_RATIOS, REAL_RATIOS
from tfq.kernels import cpu_build
from tfq.model.gguf_header import read_header
from tfq.model.load import load_model
from tiny import llama_converted, tiny_model_dir

pytestmark = pytest.mark.skipif(not cpu_build.load()[0], reason="tfq's CPU kernels do not build here")

FAMILIES = {"qwen3_moe": ("qwen3moe", REAL_RATIOS), "qwen3_5_moe": ("qwen35moe", HYBRID_RATIOS)}


@pytest.fixture(scope="module")
def converted(converter, tmp_path_factory):  # noqa: F811
    """family -> (its HF folder, {"f32": file, "q8_0": file}), each converted once."""
    made = {}

    def of(name: str):
        if name not in made:
            folder = tiny_model_dir(tmp_path_factory, name, **FAMILIES[name][1])
            out = tmp_path_factory.mktemp(f"{name}-gguf")
            made[name] = folder, {kind: llama_converted(converter, folder, out / f"{kind}.gguf", kind)
                                  for kind in ("f32", "q8_0")}
        return made[name]

    return of


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_converters_f32_file_computes_as_its_hf_folder(converted, name):
    folder, files = converted(name)
    header = read_header(files["f32"])
    assert header.metadata["general.architecture"] == FAMILIES[name][0]
    assert sum(t.name.endswith("_exps.weight") for t in header.tensors) == 3 * 4  # stacked: one a layer and kind
    reqs = requests(4)
    want = bits(run(load_model(str(folder), progress=False).model, reqs, lanes=4))
    loaded = load_model(str(files["f32"]), progress=False)
    assert loaded.config.moe == load_model(str(folder), progress=False).config.moe
    assert bits(run(loaded.model, reqs, lanes=4)) == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_quantized_experts_keep_their_blocks_with_the_bits_of_their_values(converted, name):
    kept, summary = kept_blocks_have_their_values_bits(converted(name)[1]["q8_0"])
    moe = kept.layers[-1].moe
    assert moe.experts[127].gate_up.kind == "Q8_0" and moe.experts[0].down.kind == "Q8_0"
    assert summary.step < summary.resident / 4  # a decode step at one lane reads 8 of the 128 experts


# one thread count a family here, the other than its HF folder's run in test_moe.py (the note has both);
# Qwen3's with 8-bit activations (its experts' products then go through quant_q8.cpp's linear_many)
@pytest.mark.parametrize("name, threads, weights", [("qwen3_moe", 3, "gguf-q8"), ("qwen3_5_moe", 2, "gguf")])
def test_together_on_the_converters_quantized_file_every_arm(converted, tmp_path, monkeypatch, capsys, name, threads,
                                                              weights):
    files = converted(name)[1]
    summary = tmp_path / "summary.json"
    code, out, err = tfq(["together", "--model", str(files["q8_0"]), "--suite", str(shipped_hybrid_suite()),
                          "--tokens", "32", "--threads", str(threads), "--set", f"weights={weights}", "--evidence",
                          str(tmp_path / "ev"), "--json", str(summary)], monkeypatch, capsys)
    assert code == 0, out + err
    doc = json.loads(summary.read_text())
    assert doc["versions"]["weights"] == weights
    arms = {a["arm"]: a for a in doc["arms"]}
    controls = {"partial", "paged-partial", "experts-by-load"} | (
        {"deltanet-chunks", "prefix-offset"} if name == "qwen3_5_moe" else {"prefix-partial"})
    assert controls < set(arms) and {"whole", "paged", "chunked", "preempted", "drafted"} < set(arms)
    for arm_name, arm in arms.items():
        assert arm["verdict"] == ("RED" if arm_name in controls else "EXACT"), (arm_name, arm["note"])
