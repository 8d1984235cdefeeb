"""`tfq bench serve` on a tiny model: both levels in the report, positive throughput, every reply equal to its
chat's at concurrency 1; bad input as one line (exit 2). No timed assertions: figures only have to be there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import tfq

TINY_PLAN = str(Path(__file__).resolve().parent.parent / "plans" / "tiny.yaml")


def test_bench_serve_writes_both_levels(tiny_dirs, tmp_path, monkeypatch, capsys):
    path = tmp_path / "serve.json"
    code, out, err = tfq(["bench", "serve", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN,
                          "--concurrency", "1,2", "--requests-per-level", "3", "--max-tokens", "4",
                          "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert "tfq bench serve" in out and "3/3" in out
    report = json.loads(path.read_text())
    assert set(report) >= {"settings", "plan", "machine", "levels", "reference"}
    assert report["settings"]["served_name"] == "qwen2"  # tfq.serve.background.served_name: the folder's name
    assert report["plan"]["plan"]["lanes"] == 4 and report["plan"]["lines"]
    assert report["machine"]["torch_threads"] >= 1
    # the long review chat cannot fit the tiny plan's window of 512 rows: left out, and said why
    assert [c["chat"] for c in report["settings"]["left_out"]] == ["review-long"]
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["requests"] == 3 and lv["equal_replies"] == 3
        assert lv["requests_per_s"] > 0 and lv["output_tokens_per_s"] > 0 and 0 < lv["output_tokens"] <= 12
        assert lv["ttft_ms"]["p50"] > 0 and lv["ttft_ms"]["p99"] >= lv["ttft_ms"]["p50"]
        assert len(lv["per_request"]) == 3 and all(r["equal"] for r in lv["per_request"])


@pytest.mark.parametrize("args, words", [
    (["--concurrency", "0"], "--concurrency 0"),
    (["--concurrency", "x"], "--concurrency 'x'"),
    (["--concurrency", "1,4", "--requests-per-level", "2"], "--requests-per-level 2"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_bad_input_is_one_line(args, words, monkeypatch, capsys):
    code, out, err = tfq(["bench", "serve", *args], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"tfq: {words}") and len(err.strip().splitlines()) == 1


def test_engine_bench_options_before_serve_are_refused(monkeypatch, capsys):
    code, _, err = tfq(["bench", "--lanes", "1", "serve"], monkeypatch, capsys)
    assert code == 2 and err.startswith("tfq: --lanes before `serve`") and len(err.strip().splitlines()) == 1


def test_without_concurrency_1_the_reference_is_sent_alone(tiny_dirs, monkeypatch, capsys):
    code, out, err = tfq(["bench", "serve", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet",
                          "--concurrency", "2", "--requests-per-level", "2", "--max-tokens", "2", "--json", "-"],
                         monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(out)  # '-': the JSON alone on stdout, the table on stderr
    assert report["reference"] == {"from_concurrency_1": 0, "sent_alone": 2}
    assert [(lv["concurrency"], lv["equal_replies"]) for lv in report["levels"]] == [(2, 2)]


def fake_server(tmp_path: Path, body: str) -> str:
    """A stand-in for llama-server: a shell script doing `body` (crash, hang), for the peer's faults."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("body, words", [
    ("kill -ILL $$", "llama-server died of SIGILL; rebuild it for this CPU's instruction sets without -march=native"),
    ("echo 'error: unknown argument'; exit 3", "llama-server exited with status 3 (its log ends: error: unknown"),
    ("exec sleep 600", "llama-server did not answer /health within 2 s"),
])
def test_a_peer_that_crashes_or_hangs_costs_one_line_and_tfqs_rows_stay(body, words, tmp_path, tmp_path_factory,
                                                                        monkeypatch, capsys):
    from tfq.bench.peers import llama_server
    from tiny import tiny_gguf

    monkeypatch.setenv("TFQ_LLAMA_SERVER", fake_server(tmp_path, body))
    monkeypatch.setattr(llama_server, "START_S", 2.0)
    path = tmp_path / "serve.json"
    code, out, err = tfq(["bench", "serve", "--model", str(tiny_gguf(tmp_path_factory)), "--plan", TINY_PLAN,
                          "--concurrency", "1", "--requests-per-level", "2", "--max-tokens", "3", "--peer",
                          "llama-server", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(path.read_text())
    assert [lv["equal_replies"] for lv in report["levels"]] == [2]  # tfq's rows, measured
    assert report["peer"]["levels"] == [] and report["peer"]["failure"].startswith(words)
    assert f"peer: {words}" in " ".join(out.split())


def test_a_missing_peer_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TFQ_LLAMA_SERVER", str(tmp_path / "nope"))
    code, out, err = tfq(["bench", "serve", "--peer", "llama-server"], monkeypatch, capsys)
    assert code == 2 and "benchmarks/build_llama_server.sh" in err and len(err.strip().splitlines()) == 1


def test_llama_server_beside_tfq_on_the_same_gguf(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Where llama-server is built (benchmarks/build_llama_server.sh), both engines' rows: figures present,
    and whether llama.cpp's replies under load equal its own alone is reported (not asserted: it is the
    peer's property, measured)."""
    from tfq.bench.peers.llama_server import binary
    from tfq.errors import TfqError
    from tiny import tiny_gguf

    try:
        binary()
    except TfqError:
        pytest.skip("llama-server is not built here (bash benchmarks/build_llama_server.sh)")
    path = tmp_path / "serve.json"
    code, out, err = tfq(["bench", "serve", "--model", str(tiny_gguf(tmp_path_factory)), "--plan", TINY_PLAN,
                          "--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "4", "--peer",
                          "llama-server", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    peer = json.loads(path.read_text())["peer"]
    assert peer["failure"] is None, peer["failure"]
    assert [lv["concurrency"] for lv in peer["levels"]] == [1, 2]
    assert all(lv["output_tokens_per_s"] > 0 and 0 <= lv["equal_replies"] <= lv["requests"] for lv in peer["levels"])
    assert "llama-server" in out
