"""`tfq bench` on a tiny model: the report's keys and sane numbers, and bad input as one line (exit 2).
No timed assertions: the figures only have to be measured, positive and consistent."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli import tfq
from tfq.bench import arm_plan, kv_read_bytes, mean_context, weights_read_bytes
from tfq.model.config import ModelConfig
from tfq.plan import Plan, row_bytes

ROOT = Path(__file__).resolve().parent.parent
TINY_PLAN = str(ROOT / "plans" / "tiny.yaml")
SMALL = ["--plan", TINY_PLAN, "--prompt-tokens", "12", "--tokens", "4", "--repeats", "1", "--threads", "1"]


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()  # --threads sets them for this (test) process
    yield
    torch.set_num_threads(threads)




def rows_by(report):
    return {(r["lanes"], r["arm"]): r for r in report["rows"]}


def doc_row(path: Path) -> list[str]:
    """benchmarks/bench_rows.py's row of a report, cell by cell."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rows.py"), "--no-header", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return [cell.strip() for cell in out.strip().strip("|").split("|")]


def test_bench_beside_the_peer_writes_the_report(tiny_dirs, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), *SMALL, "--lanes", "1,2", "--peer", "hf",
                          "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert "tfq whole" in out and "hf (peer)" in out and "target:" in out
    report = json.loads(path.read_text())
    assert set(report) >= {"settings", "machine", "model", "rows", "skipped", "targets"}
    assert report["peer"]["process"] == "child" and report["peer"]["version"]  # HF in a process of its own
    rows = rows_by(report)
    # paged is the whole arm at one lane (stream 0 is contiguous): skipped there, measured at two
    assert set(rows) == {(1, "whole"), (1, "partial"), (1, "drafted"), (1, "peer"),
                         (2, "whole"), (2, "paged"), (2, "partial"), (2, "drafted"), (2, "peer")}
    assert report["skipped"] == [{"lanes": 1, "arm": "paged", "why": report["skipped"][0]["why"]}]
    assert report["machine"]["bandwidth_bytes_per_s"] > 1e8
    for (lanes, arm), r in rows.items():
        assert r["rounds"] == 1 and len(r["runs"]) == 1
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert r["decode_tokens_per_s_per_stream"] == pytest.approx(r["decode_tokens_per_s"] / lanes)
        assert 0 < r["roofline_fraction"] < 1.5
        assert r["bytes_per_step"] > report["model"]["weights_read_per_step_bytes"]
        assert r["peak_rss_bytes"] > 0
        if arm == "peer":
            assert r["engine"] == "hf" and r["decode_steps"] == 3 and r["cache_bytes"] is None
            continue
        assert r["engine"] == "tfq" and r["cache_bytes"] > 0 and r["plan"]["lanes"] == lanes
        assert r["vs_peer"]["decode"] > 0 and r["vs_peer"]["prefill"] > 0
        same = r["same_reply_as_peer"]
        assert 0 <= same["whole_replies"] <= same["tokens_before_parting"] <= 1
        if arm == "drafted":  # a verify forward may keep several tokens: fewer steps
            assert 1 <= r["decode_steps"] <= 3
        else:
            assert r["decode_steps"] == 3
    assert rows[2, "paged"]["plan"]["kv_pages"] == 64 and rows[2, "whole"]["plan"]["kv_pages"] == 0
    assert rows[2, "partial"]["plan"]["attention"] == "partial"
    assert rows[2, "drafted"]["plan"]["draft"].startswith("ngram") and "drafted" in rows[2, "drafted"]
    assert any(t["target"].startswith("decode at 1 lane vs the peer") for t in report["targets"])
    probes = report["machine"]["bandwidth_start"]
    assert {"linear 1 row", "linear 2 rows", "sum"} <= {k.split(",")[0] for k in probes}
    assert report["machine"]["bandwidth_bytes_per_s"] == max(
        *probes.values(), *report["machine"]["bandwidth_end"].values())
    for lanes in (1, 2):  # the whole arm's step, split by op kind
        b = rows[lanes, "whole"]["breakdown_ms"]
        assert b["linear_ms"] > 0 and b["attention_ms"] > 0
        assert b["experts_ms"] == 0  # a dense model
        assert b["linear_ms"] + b["attention_ms"] + b["rest_ms"] == pytest.approx(b["step_ms"], abs=0.05)
        # the layers run as one object here: its calls hold part of the rest, the engine's Python around them the
        # other part (the clocks nest: the object's kernels inside its calls, its calls inside the step)
        assert 0 < b["rest_in_object_ms"] < b["rest_ms"]
        assert "breakdown_ms" not in rows[lanes, "partial"]
    assert "a whole decode step at 2 lanes" in out
    # the docs' row of it: every figure present; the control, the same report without the peer's rows, has none of
    # the peer's
    cells = doc_row(path)
    assert len(cells) == 11 and cells[0] == "bench" and not any("-" in cell.split() for cell in cells), cells
    report["rows"] = [{**r, "vs_peer": None, "same_reply_as_peer": None} for r in report["rows"] if r["arm"] != "peer"]
    (tmp_path / "alone.json").write_text(json.dumps(report))
    alone = doc_row(tmp_path / "alone.json")
    assert alone[2:5] == ["-", "**-**", "-"] and alone[7].endswith("/ -") and alone[10] == "-", alone


def test_bench_without_a_peer(tiny_dirs, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen3"]), *SMALL, "--lanes", "3", "--peer", "none",
                          "--arms", "paged,whole", "--quiet", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    assert "hf (peer)" not in out and "stream 0" not in err + out  # --quiet: no plan lines
    rows = rows_by(json.loads(path.read_text()))
    assert set(rows) == {(3, "paged"), (3, "whole")}
    assert all(r["vs_peer"] is None and r["decode_tokens_per_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("args, says", [
    (["--lanes", "0"], "--lanes 0"),
    (["--lanes", "1,x"], "--lanes"),
    (["--lanes", "1,16"], "raise the plan key lanes (--set lanes=16"),
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--peer", "vllm"], "--peer 'vllm'"),
    (["--arms", "whole,fast"], "unknown arm 'fast'"),
    (["--prompt-tokens", "500", "--tokens", "100"], "raise the plan key window"),
])
def test_bad_input_is_one_line(tiny_dirs, monkeypatch, capsys, args, says):
    code, out, err = tfq(["bench", "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--quiet", "--lanes", "1",
                          *args],
                         monkeypatch, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("tfq: ") and says in err, err


def test_roofline_bytes_count_linears_head_and_cache_not_the_embedding():
    cfg = ModelConfig(family="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_eps=1e-6, max_positions=512,
                      tie_embeddings=False, weights_dtype="float32")
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + (64 + 2 * 32) + 2 * 64
    assert weights_read_bytes(cfg) == 4 * (2 * per_layer + 64 + 1000 * 64)
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert weights_read_bytes(tied) == weights_read_bytes(cfg)  # the head reads the (shared) table once
    assert mean_context(100, 20) == 110
    assert kv_read_bytes(cfg, "bf16", 3, 110) == 3 * 110 * row_bytes(cfg, "bf16") == 3 * 110 * 2 * 2 * 2 * 16 * 2


def test_arm_plans_change_only_their_keys():
    base = Plan(window=4096, lanes=8, prefill_chunk=256).set("kv.dtype", "bf16")
    paged = arm_plan(base, "paged", 4, 512)
    assert (paged.kv.pages, paged.kv.paged, paged.kv.pool, paged.lanes, paged.window) == (256, "more", 6, 4, 512)
    assert paged.kv.dtype == "bf16" and paged.prefill_chunk == 256 and paged.source("kv.pages") == "bench paged"
    assert arm_plan(base, "partial", 2, 512).attention == "partial"
    assert arm_plan(base, "drafted", 2, 512).draft == "ngram:4"
    assert arm_plan(base.set("draft", "ngram:2"), "drafted", 2, 512).draft == "ngram:2"
    assert arm_plan(base.set("draft", "ngram:2"), "whole", 2, 512).draft == "none"


def test_the_warm_up_meets_every_shape_without_the_whole_prompt():
    """A long-context bench's warm-up round cuts its prompts to WARMUP_PROMPT tokens (or the plan's prefill chunk,
    if longer): prompt chunks and decode rows are all met, and a 32k prompt is not prefilled twice."""
    from types import SimpleNamespace

    from tfq.bench.rounds import WARMUP_PROMPT, round_prompts

    long, short = [list(range(3000))] * 2, [list(range(40))]
    assert [len(p) for p in round_prompts(long, SimpleNamespace(prefill_chunk=512), -1)] == [WARMUP_PROMPT] * 2
    assert [len(p) for p in round_prompts(long, SimpleNamespace(prefill_chunk=2048), -1)] == [2048] * 2
    assert round_prompts(long, SimpleNamespace(prefill_chunk=512), 0) == long  # timed rounds: the whole prompt
    assert round_prompts(short, SimpleNamespace(prefill_chunk=512), -1) == short
