"""Qwen3.5 hybrids as GGUF files (qwen35), written by llama.cpp's own converter from a random transformers model:
the file computes as its HF folder does, bit for bit (value heads back in grouped order, norms and A as the file
stores them), its quantized blocks as their dequantized values, and the plan counts the bytes the model keeps."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engines import alone, bits, run
from test_hybrid import requests, shipped_hybrid_suite
from tfq.kernels import cpu_build
from tfq.model import gguf_kept, gguf_tensors
from tfq.model.gguf_header import read_header
from tfq.model.gguf_kept import kept_summary
from tfq.model.load import load_model
from tiny import held_bytes, llama_converted, llama_converter, tiny_model_dir

pytestmark = pytest.mark.skipif(not cpu_build.load()[0], reason="tfq's CPU kernels do not build here")


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    root = llama_converter(tmp_path_factory.mktemp("llama-sdist"))
    if root is None:
        pytest.skip("the llama-cpp-python sdist (llama.cpp's converter) cannot be downloaded here")
    return root


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The real small Qwen3.5's ratios: three DeltaNet layers to one attention layer, three value heads a key
    head (so the converter reorders them), tied embeddings; branches scaled so prompt lookup finds guesses."""
    return tiny_model_dir(tmp_path_factory, "qwen3_5", tie=True, seed=4, layers=8, hidden=192, heads=6,
                          kv_heads=1, head_dim=64, intermediate=640, linear_heads=(2, 6), linear_dims=(32, 32),
                          branch_scale=0.3)


@pytest.fixture(scope="module")
def files(converter, hf_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen35-gguf")
    return {kind: llama_converted(converter, hf_folder, out / f"tiny-{kind}.gguf", kind) for kind in ("f32", "q8_0")}


def test_the_converters_f32_file_computes_as_its_hf_folder(files, hf_folder, monkeypatch):
    """Every stream's ids and logits bits from the file equal those from the folder it was converted from. The
    control: leaving the value heads in the file's tiled order gives other bits."""
    assert read_header(files["f32"]).metadata["general.architecture"] == "qwen35"
    reqs = requests(4)
    want = bits(run(load_model(str(hf_folder), progress=False).model, reqs, lanes=4))
    assert bits(run(load_model(str(files["f32"]), progress=False).model, reqs, lanes=4)) == want

    real = gguf_tensors.hf_layouts
    monkeypatch.setattr(gguf_kept, "hf_layouts", lambda h: {  # where the file's kept weights take their layouts
        name: dataclasses.replace(layout, rows=None, cols=None) for name, layout in real(h).items()})
    assert bits(run(load_model(str(files["f32"]), progress=False).model, reqs, lanes=4)) != want


def kept_blocks_have_their_values_bits(path):
    """weights: gguf on the file against weights: fp32 on it, four together and each alone: the same ids and
    logits bits; the kept model holds the bytes the plan counts (the fp32 model other bytes: the control). Returns
    (the kept model, the file's kept_summary)."""
    kept = load_model(str(path), progress=False, weights="gguf")
    fp32 = load_model(str(path), progress=False, weights="fp32")
    reqs = requests(4)
    want = bits(run(fp32.model, reqs, lanes=4))
    assert bits(run(kept.model, reqs, lanes=4)) == want
    assert bits(alone(kept.model, reqs)) == want
    summary = kept_summary(read_header(path))
    assert held_bytes(kept.model) == summary.resident != held_bytes(fp32.model)
    return kept.model, summary


def test_the_quantized_file_keeps_its_blocks_with_the_bits_of_their_values(files):
    """weights: gguf (Q8_0 blocks kept, out_proj's inputs reordered by whole groups) against weights: fp32 on the
    same file, alone and four together; the plan's weights are the bytes the model holds."""
    delta = kept_blocks_have_their_values_bits(files["q8_0"])[0].layers[0]
    assert (delta.in_proj.kind, delta.out_proj.kind) == ("Q8_0", "Q8_0")


def test_plan_reads_a_qwen35_file(files, monkeypatch, capsys):
    from cli import tfq

    code, out, err = tfq(["plan", "--model", str(files["q8_0"])], monkeypatch, capsys)
    assert code == 0, err
    assert "qwen3_5, 8 layers (6 Gated DeltaNet + 2 gated attention" in out
    assert "weights kept:" in out and "Q8_0" in out


@pytest.mark.slow
def test_together_on_the_converters_quantized_file_every_arm(files, tmp_path, monkeypatch, capsys):
    """`tfq together --model FILE.gguf` on the Q8_0 file llama.cpp's converter wrote: every arm EXACT, every control
    RED."""
    from cli import tfq

    summary = tmp_path / "summary.json"
    code, out, err = tfq(["together", "--model", str(files["q8_0"]), "--suite", str(shipped_hybrid_suite()),
                          "--tokens", "32", "--evidence", str(tmp_path / "ev"), "--json", str(summary)],
                         monkeypatch, capsys)
    assert code == 0, out + err
    arms = {a["arm"]: a for a in json.loads(summary.read_text())["arms"]}
    controls = {"partial", "paged-partial", "deltanet-chunks", "prefix-offset"}
    assert controls < set(arms) and {"whole", "paged", "chunked", "preempted", "drafted", "prefix"} < set(arms)
    for name, arm in arms.items():
        assert arm["verdict"] == ("RED" if name in controls else "EXACT"), (name, arm["note"])
    assert arms["prefix"]["reused_rows"] > 0 and arms["prefix-offset"]["reused_rows"] > 0
