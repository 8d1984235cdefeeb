"""llama.cpp as the bench's peer: the F32 file it runs holds exactly the weights tfq computes with, bad input is
one line, and (where llama-cpp-python is installed) a bench beside it on a tiny GGUF writes its rows."""
from __future__ import annotations

import json
import sys
import types

import pytest

from tfq.bench import weights_read_bytes
from tfq.model.config import ModelConfig
import torch
from safetensors.torch import load_file

from cli import tfq
from tiny import tiny_gguf
from test_bench import SMALL, TINY_PLAN, rows_by


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_f32_file_holds_the_weights_tfq_computes_with(tmp_path_factory, tmp_path):
    import gguf

    from tfq.bench.llama_peer import write_f32_gguf
    from tfq.model import gguf_file

    source = tiny_gguf(tmp_path_factory)
    assert any(t.tensor_type != gguf.GGMLQuantizationType.F32 for t in gguf.GGUFReader(str(source)).tensors)
    f32 = tmp_path / "f32.gguf"
    write_f32_gguf(source, f32, progress=False)
    reader = gguf.GGUFReader(str(f32))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert reader.get_field(gguf.Keys.General.FILE_TYPE).contents() == 0
    before = gguf.GGUFReader(str(source))
    for name, field in before.fields.items():  # every other entry copied as it was
        if not name.startswith("GGUF.") and name != gguf.Keys.General.FILE_TYPE:
            assert reader.get_field(name).contents() == field.contents(), name
    # tfq converts both files into the same fp32 tensors, bit for bit: the peer runs tfq's own weights
    folders = []
    for i, path in enumerate((source, f32)):
        folders.append(tmp_path / f"converted{i}")
        folders[-1].mkdir()
        gguf_file.convert(path, folders[-1], progress=False)
    a, b = (load_file(str(f / "model.safetensors")) for f in folders)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_missing_llama_cpp_names_the_install_command(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          "--peer", "llama.cpp"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert 'pip install -e ".[peer-llama]"' in err and "--peer hf or none" in err


def test_llama_cpp_needs_a_gguf_model(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="0"))  # installed, as far as asked
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          "--peer", "llama.cpp-gguf"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "runs a GGUF file" in err, err


@pytest.mark.parametrize("peer,weights", [("llama.cpp", "fp32"), ("llama.cpp", "gguf"), ("llama.cpp-gguf", "gguf")])
def test_bench_beside_llama_cpp(tmp_path_factory, tmp_path, monkeypatch, capsys, peer, weights):
    """--peer llama.cpp runs the weights tfq computes with: the F32 twin beside weights: fp32, the file as shipped
    beside weights: gguf (tfq's quantized kernel)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (peer-llama)")
    monkeypatch.setenv("TFQ_CACHE", str(tmp_path / "cache"))
    model = tiny_gguf(tmp_path_factory)
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(model), *SMALL, "--lanes", "1,2", "--arms", "whole", "--peer", peer,
                          "--set", f"weights={weights}", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert f"{peer} (peer)" in out
    report = json.loads(path.read_text())
    assert report["machine"]["peer"] == peer and report["machine"]["peer_version"]
    rows = rows_by(report)
    assert set(rows) == {(1, "whole"), (1, "peer"), (2, "whole"), (2, "peer")}
    for lanes in (1, 2):
        p = rows[lanes, "peer"]
        assert p["engine"] == "llama.cpp" and p["decode_steps"] == 3 and p["decode_tokens_per_s"] > 0
        assert rows[lanes, "whole"]["vs_peer"]["decode"] > 0
        assert 0 <= rows[lanes, "whole"]["same_reply_as_peer"]["whole_replies"] <= 1
    assert report["model"]["weights"] == weights
    twin = tmp_path / "cache" / "peer"
    if peer == "llama.cpp" and weights == "fp32":
        assert any("vs llama.cpp on F32" in t["target"] for t in report["targets"])
        assert twin.is_dir() and list(twin.glob("*-f32.gguf"))  # the F32 twin is written once, into tfq's cache
    elif peer == "llama.cpp":
        assert any("vs llama.cpp on its GGUF file" in t["target"] for t in report["targets"])
        assert not twin.exists()  # the file as shipped: no twin
    if weights == "gguf":  # a quantized step reads fewer bytes than the fp32 one
        fp32 = weights_read_bytes(ModelConfig.from_folder(report["settings"]["folder"]))
        assert report["model"]["weights_read_per_step_bytes"] < fp32
