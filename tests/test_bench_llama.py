"""llama.cpp as the bench's peer: the F32 file it runs holds exactly the weights tfq computes with, bad input is
one line, a peer that dies in its child process leaves tfq's rows standing, a peer that does not fit beside
tfq runs apart, and (where llama-cpp-python is installed) a bench beside it on a tiny GGUF writes its rows.
The HF peer runs in the same child process (its engine named on the child's command line): a missing
transformers and a death of it are one line too.

The tests of the child's protocol run a fake child (FAKE_CHILD), so they need no llama-cpp-python."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cli import tfq
from test_bench import SMALL, TINY_PLAN, rows_by
from tfq.bench import weights_read_bytes
from tfq.bench.peers import choice, parent_end
from tfq.bench.peers.choice import peer_order
from tfq.model.config import ModelConfig
from tiny import tiny_gguf


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_f32_file_holds_the_weights_tfq_computes_with(tmp_path_factory, tmp_path):
    import gguf

    from tfq.bench.peers.llama import write_f32_gguf
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


@pytest.mark.parametrize("module, peer, says", [
    ("llama_cpp", "llama.cpp", ('pip install -e ".[peer-llama]"', "--peer hf or none")),
    ("transformers", "hf", ('tfq: --peer hf needs HF transformers, which is not installed; install it with: pip '
                            'install -e ".[peer]", or pass --peer none',))])
def test_a_missing_peer_package_names_the_install_command(tiny_dirs, monkeypatch, capsys, module, peer, says):
    # the real child, where importing the peer's package raises ImportError
    blocked = (f"import runpy, sys; sys.modules['{module}'] = None; "
               "runpy.run_module('tfq.bench.peers.child_end', run_name='__main__')")
    monkeypatch.setattr(parent_end, "CHILD", [sys.executable, "-c", blocked])
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          "--peer", peer], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(s in err for s in says), err


def test_an_hf_peer_that_dies_leaves_tfqs_rows(tiny_dirs, tmp_path, monkeypatch, capsys):
    log = fake_child(tmp_path, monkeypatch, "die:SIGKILL:2")  # as the kernel's OOM killer would end it
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), *SMALL, "--lanes", "1,2", "--arms", "whole",
                          "--peer", "hf", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert err.strip().splitlines() == [
        "the peer (hf) died with SIGKILL (killed) during lanes 1, round 1: tfq's rows stand without it"]
    report = json.loads(path.read_text())
    assert set(rows_by(report)) == {(1, "whole"), (2, "whole")} and report["peer"]["process"] == "child"
    assert log.read_text() == "run\nrun\n"  # the warm-up, then the round it died in


def test_llama_cpp_needs_a_gguf_model(tiny_dirs, tmp_path, monkeypatch, capsys):
    log = fake_child(tmp_path, monkeypatch, "ok")  # installed, as far as asked
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          "--peer", "llama.cpp-gguf"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "runs a GGUF file" in err, err
    assert log.read_text() == "exits\n"  # the child was closed


def test_a_file_llama_cpp_cannot_load_is_one_line(tmp_path_factory, tmp_path, monkeypatch, capsys):
    fake_child(tmp_path, monkeypatch, "refuse")
    code, out, err = tfq(["bench", "--model", str(tiny_gguf(tmp_path_factory)), *SMALL, "--lanes", "1", "--arms",
                          "whole", "--peer", "llama.cpp-gguf", "--quiet"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == ["tfq: llama.cpp cannot load it"], err


@pytest.mark.parametrize("mode,says", [
    ("die:SIGSEGV:1", "died with SIGSEGV (segmentation fault) during lanes 1, the warm-up"),
    ("die:SIGILL:3", "died with SIGILL (illegal instruction) during lanes 2, the warm-up"),
    ("noise:2", "answered with a line that is not a JSON object ('llama.cpp says hello') during lanes 1, round 1"),
    ("mute", "did not answer within 0.25 s while loading"),
])
def test_a_peer_that_dies_leaves_tfqs_rows(tmp_path_factory, tmp_path, monkeypatch, capsys, mode, says):
    fake_child(tmp_path, monkeypatch, mode)
    if mode == "mute":  # it never answers its load: the timeout, shortened, ends the wait
        monkeypatch.setattr(parent_end, "LOAD_TIMEOUT_S", 0.25)
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_gguf(tmp_path_factory)), *SMALL, "--lanes", "1,2", "--arms",
                          "whole", "--peer", "llama.cpp-gguf", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    line = f"the peer (llama.cpp-gguf) {says}: tfq's rows stand without it"
    if "SIGILL" in mode:  # the line says how to mend it
        line += f"; {parent_end.REBUILD}"
    assert err.strip().splitlines() == [line]
    report = json.loads(path.read_text())
    assert report["peer"]["failure"] == line and f"peer: {line}" in " ".join(out.split())
    rows = rows_by(report)
    lanes_done = {1} if mode.endswith(":3") else set()  # a lane count's peer rounds all ran, or its row goes
    assert set(rows) == {(1, "whole"), (2, "whole")} | {(n, "peer") for n in lanes_done}
    for lanes in (1, 2):
        whole = rows[lanes, "whole"]
        assert whole["decode_tokens_per_s"] > 0 and whole["decode_steps"] == 3
        assert (whole["vs_peer"] is not None) == (lanes in lanes_done)


def test_the_peer_runs_apart_when_both_engines_do_not_fit():
    assert not peer_order(10, 5, 15).apart and peer_order(10, 5, 15).name == "interleaved"  # just fits
    apart = peer_order(10, 6, 15)
    assert apart.apart and apart.name == "apart"
    assert apart.words() == "tfq's plan 10 bytes + the peer's file 6 bytes > 15 bytes available"
    gib = 2**30  # the 27B shape on this machine: tfq's plan and the 16.2 GB file against 24 GiB
    assert peer_order(int(17.15 * gib), 16_220_000_000, 22 * gib).apart
    assert not peer_order(int(2.2 * gib), 1_100_000_000, 22 * gib).apart  # the default model


def test_a_bench_forced_apart_runs_the_peer_first_then_tfq(tmp_path_factory, tmp_path, monkeypatch, capsys):
    from tfq.model import load

    log = fake_child(tmp_path, monkeypatch, "ok")
    monkeypatch.setattr(choice, "available_memory", lambda: 1)  # nothing fits beside tfq
    load_model = load.load_model

    def logged_load(*args, **kwargs):
        with log.open("a") as f:
            f.write("tfq loads\n")
        return load_model(*args, **kwargs)

    monkeypatch.setattr(load, "load_model", logged_load)
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_gguf(tmp_path_factory)), *SMALL, "--lanes", "1,2", "--arms",
                          "whole", "--peer", "llama.cpp-gguf", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    # every peer run (2 lane counts x warm-up and a round), its exit, then tfq's load
    assert log.read_text().splitlines() == ["run"] * 4 + ["exits", "tfq loads"]
    report = json.loads(path.read_text())
    peer = report["peer"]
    assert peer["order"] == "apart" and peer["failure"] is None and peer["version"] == "fake 1.0"
    assert peer["memory"]["available_bytes"] == 1 and " > " in peer["order_why"]
    rows = rows_by(report)
    assert set(rows) == {(1, "whole"), (1, "peer"), (2, "whole"), (2, "peer")}
    assert all(rows[n, "whole"]["vs_peer"]["decode"] > 0 for n in (1, 2))
    assert "pair of runs apart" in " ".join(out.split())


def test_the_child_does_not_import_torch():
    """The peer's memory column is llama.cpp's process: torch's hundreds of MiB are not in it."""
    subprocess.run([sys.executable, "-c", "import sys, tfq.bench.peers.child_end; assert 'torch' not in sys.modules"],
                   check=True)


@pytest.mark.parametrize("peer,weights,order", [
    ("llama.cpp", "fp32", "interleaved"), ("llama.cpp", "gguf", "interleaved"),
    ("llama.cpp-gguf", "gguf", "interleaved"), ("llama.cpp", "gguf", "apart"),
])
def test_bench_beside_llama_cpp(tmp_path_factory, tmp_path, monkeypatch, capsys, peer, weights, order):
    """--peer llama.cpp runs the weights tfq computes with: the F32 twin beside weights: fp32, the file as shipped
    beside weights: gguf (tfq's quantized kernel); in a child process, interleaved or apart."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (peer-llama)")
    monkeypatch.setenv("TFQ_CACHE", str(tmp_path / "cache"))
    if order == "apart":
        monkeypatch.setattr(choice, "available_memory", lambda: 1)
    model = tiny_gguf(tmp_path_factory)
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(model), *SMALL, "--lanes", "1,2", "--arms", "whole", "--peer", peer,
                          "--set", f"weights={weights}", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert f"{peer} (peer)" in out
    report = json.loads(path.read_text())
    assert report["machine"]["peer"] == peer and report["machine"]["peer_version"]
    assert report["peer"]["order"] == order and report["peer"]["process"] == "child" and not report["peer"]["failure"]
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


FAKE_CHILD = """
import json, os, resource, signal, sys

mode, log = sys.argv[1], sys.argv[2]
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of its death


def say(reply):
    print(json.dumps(reply), flush=True)


def note(what):
    with open(log, "a") as f:
        f.write(what + "\\n")


say({"version": "fake 1.0"})
runs = 0
for line in sys.stdin:
    r = json.loads(line)
    if r["op"] == "close":
        break
    if r["op"] == "load" and mode == "mute":
        continue
    if r["op"] == "load" and mode == "refused":  # as ik_llama.cpp refuses a model its build does not know
        say({"error": "ik_llama.cpp cannot load it", "refused": True})
    elif r["op"] == "load":
        say({"error": "llama.cpp cannot load it"} if mode == "refuse" else {"ok": True, "rss_peak_is_per_run": True})
    elif r["op"] == "prepare":
        say({"ok": True})
    elif r["op"] == "run":
        runs += 1
        note("run")
        kind, _, at = mode.partition(":")
        if kind == "die" and runs == int(at.split(":")[1]):
            os.kill(os.getpid(), getattr(signal, at.split(":")[0]))
        if kind == "noise" and runs == int(at):
            print("llama.cpp says hello", flush=True)
        n, t = len(r["prompts"]), r["tokens"]
        say({"run": {"engine": "llama.cpp", "arm": "peer", "lanes": n, "round": r["round"], "first_token_s": 0.01,
                     "total_s": 0.01 + 0.001 * t, "decode_steps": t - 1, "replies": [p[:1] * t for p in r["prompts"]],
                     "peak_rss": 2**20, "run_rss": 0}})
note("exits")
"""


def fake_child(tmp_path, monkeypatch, mode: str):
    """The peer's child command made a fake llama.cpp child speaking the same protocol (no llama-cpp-python
    needed): `ok`; `refuse` its load; `refused`, its load marked refused; `mute`, no answer to its load;
    `die:SIGNAL:N`, killed by SIGNAL at its Nth run; `noise:N`, a line that is not JSON before its Nth run's
    answer. Returns the log it writes: "run" a run, "exits" at its end."""
    script, log = tmp_path / "fake_child.py", tmp_path / "fake_child.log"
    script.write_text(FAKE_CHILD)
    log.write_text("")
    monkeypatch.setattr(parent_end, "CHILD", [sys.executable, str(script), mode, str(log)])
    return log
