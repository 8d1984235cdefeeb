"""ik_llama.cpp as the bench's peer (`--peer ik_llama.cpp`): the name is one the bench takes, a machine without its
build gets one line saying how to build it, a model it refuses costs its rows and one line (tfq's stand), and
(where benchmarks/build_ik_llama.sh has built it) it runs beside tfq on the default model in its child process.

The refusal test runs a fake child (test_bench_llama.FAKE_CHILD), so it needs no build."""
from __future__ import annotations

import json

import pytest

from cli import tfq
from test_bench import SMALL, TINY_PLAN, rows_by
from test_bench_llama import fake_child
from tfq.bench.peers import choice, llama
from tfq.bench.peers.ik_llama import ik_folder
from tfq.bench.settings import PEERS, BenchSettings, check_settings
from tfq.errors import TfqError
from tiny import tiny_gguf

BUILT = (ik_folder() / "ik_llama_cpp" / "lib" / "libllama.so").is_file()
NOT_BUILT = f"no ik_llama.cpp build in {ik_folder()} (nice -n 10 bash benchmarks/build_ik_llama.sh builds it)"


def test_the_bench_takes_the_name_and_its_child_engine():
    assert "ik_llama.cpp" in PEERS and choice.ENGINES["ik_llama.cpp"] == "ik_llama.cpp"
    check_settings(BenchSettings(peer="ik_llama.cpp"))  # taken
    with pytest.raises(TfqError) as e:  # the control: a name the bench does not know is refused, naming this one
        check_settings(BenchSettings(peer="ik_llama"))
    assert "ik_llama.cpp (the fork" in str(e.value)


def test_no_build_is_one_line_saying_how_to_build_it(tiny_dirs, tmp_path, monkeypatch, capsys):
    # the real child, pointed at an empty folder
    monkeypatch.setenv("TFQ_IK_LLAMA", str(tmp_path / "nothing"))
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          "--peer", "ik_llama.cpp"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"tfq: --peer ik_llama.cpp needs ik_llama.cpp built for this machine, and {tmp_path / 'nothing'} holds no "
        f"build; build it once with: nice -n 10 bash benchmarks/build_ik_llama.sh (10-20 minutes on two cores; "
        f"TFQ_IK_LLAMA names another build), or pass --peer llama.cpp, hf or none"], err


@pytest.mark.parametrize("mode", ["refused", "refuse"])
def test_a_model_it_refuses_costs_its_rows_and_one_line(tmp_path_factory, tmp_path, monkeypatch, capsys, mode):
    """`refused` (a model its build does not know): tfq's rows stand. The control, `refuse` (a load error not
    marked refused, as llama.cpp's are): bad input, the bench stops with code 2."""
    log = fake_child(tmp_path, monkeypatch, mode)
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_gguf(tmp_path_factory)), *SMALL, "--lanes", "1,2", "--arms",
                          "whole", "--peer", "ik_llama.cpp", "--quiet", "--json", str(path)], monkeypatch, capsys)
    if mode == "refuse":
        assert code == 2 and err.strip().splitlines() == ["tfq: llama.cpp cannot load it"], err
        return
    assert code == 0, err
    line = ("the peer (ik_llama.cpp) refused the model (ik_llama.cpp cannot load it) while loading: tfq's rows stand "
            "without it")
    assert err.strip().splitlines() == [line]
    report = json.loads(path.read_text())
    assert report["peer"]["failure"] == line and set(rows_by(report)) == {(1, "whole"), (2, "whole")}
    assert "run" not in log.read_text()  # no run reached it


@pytest.mark.skipif(not BUILT, reason=NOT_BUILT)
def test_a_file_it_cannot_load_is_refused_by_the_real_child(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """The real ik_llama.cpp on a GGUF whose architecture its build does not know: one line, tfq's rows."""
    import gguf

    source = tiny_gguf(tmp_path_factory)
    reader = gguf.GGUFReader(str(source))
    data = bytearray(source.read_bytes())
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    at = int(field.data[0])  # the part that holds the string's bytes: "qwen2" becomes "qwenX", same length
    start = sum(p.nbytes for p in field.parts[:at])  # offset of that part within the field
    where = field.offset + start
    assert bytes(data[where:where + 5]) == b"qwen2"
    data[where:where + 5] = b"qwenX"
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(data)
    monkeypatch.setattr(llama, "peer_gguf", lambda *a, **k: bogus)  # the peer gets the bogus file, tfq the tiny one
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(source), *SMALL, "--lanes", "1", "--arms", "whole", "--peer",
                          "ik_llama.cpp", "--set", "weights=gguf", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("the peer (ik_llama.cpp) refused the model (ik_llama.cpp cannot "
                                                   "load bogus.gguf"), err
    assert set(rows_by(json.loads(path.read_text()))) == {(1, "whole")}


@pytest.mark.skipif(not BUILT, reason=NOT_BUILT)
def test_bench_beside_ik_llama_on_the_default_model(shared_default, tmp_path, monkeypatch, capsys):
    """The real ik_llama.cpp on the default model's GGUF file, as shipped, in its child process: its rows beside
    tfq's, its replies greedy on the same weights."""
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--prompt-tokens", "16", "--tokens", "4", "--repeats", "1", "--threads", "1",
                          "--lanes", "1,2", "--arms", "whole", "--peer", "ik_llama.cpp", "--quiet", "--json",
                          str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert "ik_llama.cpp (peer)" in out
    report = json.loads(path.read_text())
    assert report["machine"]["peer"] == "ik_llama.cpp" and report["machine"]["peer_version"].startswith(
        "ik-llama-cpp-python ")
    assert report["peer"]["process"] == "child" and not report["peer"]["failure"]
    assert report["peer"]["file"].endswith(".gguf") and "-f32" not in report["peer"]["file"]  # the file as shipped
    rows = rows_by(report)
    assert set(rows) == {(1, "whole"), (1, "peer"), (2, "whole"), (2, "peer")}
    for lanes in (1, 2):
        p = rows[lanes, "peer"]
        assert p["engine"] == "ik_llama.cpp" and p["decode_steps"] == 3 and p["decode_tokens_per_s"] > 0
        assert rows[lanes, "whole"]["vs_peer"]["decode"] > 0
        assert 0 <= rows[lanes, "whole"]["same_reply_as_peer"]["whole_replies"] <= 1
    assert any("vs ik_llama.cpp on its GGUF file" in t["target"] for t in report["targets"])
