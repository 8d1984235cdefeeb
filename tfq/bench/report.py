"""The bench's figures: medians over the rounds, tfq/peer ratios, the roofline fraction, agreement with the
peer's replies, the issue's targets, and the JSON report."""
from __future__ import annotations

import os
import statistics
from typing import Sequence

import torch

from tfq.bench.measure import kv_read_bytes, mean_context, weights_read_bytes
from tfq.bench.memory import MemoryProbe
from tfq.bench.record import Run
from tfq.bench.rounds import Bench
from tfq.bench.settings import bench_window
from tfq.model.footprint import KEPT_GGUF


def bench_rows(bench: Bench, bandwidth: float) -> list[dict]:
    """One row per lane count and arm (and the peer): medians of its rounds, against the roofline."""
    s = bench.settings
    out = []
    context = mean_context(s.prompt_tokens, s.tokens)
    for lanes in s.lanes:
        weights = weights_read_bytes(bench.config, bench.loaded.model, lanes)
        peer_runs = {r.round: r for r in bench.runs if r.lanes == lanes and r.arm == "peer"}
        names = bench.arms_at(lanes) + (["peer"] if peer_runs else [])
        for arm in names:
            runs = [r for r in bench.runs if r.lanes == lanes and r.arm == arm]
            figs = [r.figures(s.prompt_tokens) for r in runs]
            row = {"lanes": lanes, "engine": runs[0].engine, "arm": arm, "rounds": len(runs)}
            for key in figs[0]:
                row[key] = _median([f[key] for f in figs])
            kv_dtype = bench.plans[lanes, arm].kv.dtype if arm != "peer" else "fp32"
            step_bytes = weights + kv_read_bytes(bench.config, kv_dtype, lanes, context)
            row["bytes_per_step"] = int(step_bytes)
            row["roofline_step_s"] = step_bytes / bandwidth
            row["roofline_fraction"] = (row["roofline_step_s"] / row["step_s"]) if row["step_s"] else None
            row["cache_bytes"] = bench.cache_bytes.get((lanes, arm))
            if arm != "peer":
                p = bench.plans[lanes, arm]
                row["plan"] = {"window": p.window, "lanes": p.lanes, "kv_dtype": p.kv.dtype,
                               "kv_pages": p.kv.pages, "kv_paged": p.kv.paged, "kv_pool": p.kv.pool,
                               "attention": p.attention, "draft": p.draft, "prefill_chunk": p.prefill_chunk}
                row["vs_peer"] = _ratios(runs, peer_runs, s.prompt_tokens) if peer_runs else None
                if arm == "drafted":
                    proposed, accepted = sum(r.proposed for r in runs), sum(r.accepted for r in runs)
                    row["drafted"] = {"proposed": proposed, "accepted": accepted,
                                      "acceptance": accepted / proposed if proposed else None}
                if peer_runs:
                    row["same_reply_as_peer"] = _agreement(runs, peer_runs, bench.eos_ids())
            if arm == "whole" and lanes in bench.breakdown:
                row["breakdown_ms"] = bench.breakdown[lanes]
            row["runs"] = figs
            out.append(row)
    return out


def _median(values: Sequence):
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratios(runs: list[Run], peer_runs: dict[int, Run], prompt_tokens: int) -> dict:
    """Medians of tfq/peer per round: each ratio is of two runs side by side."""
    out = {}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        ratios = []
        for r in runs:
            mine, theirs = r.figures(prompt_tokens)[key], peer_runs[r.round].figures(prompt_tokens)[key]
            if mine and theirs:
                ratios.append(mine / theirs)
        out[key.replace("_tokens_per_s", "")] = _median(ratios)
    return out


def _agreement(runs: list[Run], peer_runs: dict[int, Run], eos: frozenset[int]) -> dict:
    """How far tfq's replies follow the peer's (same weights, both greedy in fp32, sums in other orders, so
    a near tie may part them). Compared up to tfq's first EOS: there the peer, held by min_new_tokens, must
    draw something else."""
    whole = lead = total = 0
    for r in runs:
        for mine, theirs in zip(r.replies, peer_runs[r.round].replies):
            n = next((i for i, t in enumerate(mine) if t in eos), len(mine))
            parting = next((i for i in range(n) if mine[i] != theirs[i]), n)
            whole += parting == n
            lead += parting / n if n else 1.0
            total += 1
    return {"whole_replies": whole / total, "tokens_before_parting": lead / total}


def build_report(bench: Bench, bandwidths: tuple[dict, dict], loads: tuple, wall: float) -> dict:
    """Everything the run measured, JSON-ready. The bandwidth used is the best read of the start and the end
    (measure_bandwidth): on a shared machine the best read is the nearest to the physical limit."""
    import platform

    s, config = bench.settings, bench.config
    bandwidth = max(max(b.values()) for b in bandwidths)
    rows = bench_rows(bench, bandwidth)
    return {
        "settings": {"model": bench.base.model, "folder": str(bench.loaded.folder), "lanes": list(s.lanes),
                     "prompt_tokens": s.prompt_tokens, "tokens": s.tokens, "repeats": s.repeats, "peer": s.peer,
                     "arms": list(s.arms), "seed": s.seed, "window": bench_window(bench.base, s)},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "peer": bench.peer.name if bench.peer else None,
                    "peer_version": bench.peer.version if bench.peer else None,
                    "python": platform.python_version(), "load_average_before": list(loads[0]),
                    "load_average_after": list(loads[1]), "bandwidth_bytes_per_s": bandwidth,
                    "bandwidth_start": bandwidths[0], "bandwidth_end": bandwidths[1],
                    "rss_peak_is_per_run": MemoryProbe().resettable},
        "model": {"family": config.family, "parameters": config.param_count(),
                  "weights": bench.loaded.weights,
                  "weights_read_per_step_bytes": weights_read_bytes(config, bench.loaded.model)},
        "peer": bench.peer.report() if bench.peer else None,  # where it ran, beside or apart, and any failure
        "wall_s": wall,
        "rows": rows,
        "skipped": bench.skipped,
        "targets": targets(rows, s.peer, bench.loaded.weights),
    }


def targets(rows: list[dict], peer: str = "hf", weights: str = "fp32") -> list[dict]:
    """The targets set for this machine, where the run measured what they need: against HF transformers
    (1.5x at one lane, 3x at eight) and against llama.cpp on the same weights (at least even, decode at
    every lane count and prefill; on the GGUF's own blocks, decode at one lane 1.3x as the goal beyond; peak
    memory at most the peer's plus 10%), and against ik_llama.cpp on the same file (the goal: ahead, decode and
    prefill at every lane count; memory as llama.cpp's); a decode step of one lane no slower than one of more
    lanes on the same weights. A target with `most` is met at or below its goal, the others at or above it."""
    by = {(r["lanes"], r["arm"]): r for r in rows}
    out = []

    def add(what: str, value, goal: float, most: bool = False) -> None:
        if value is not None:
            out.append({"target": what, "value": value, "goal": goal, "most": most,
                        "met": value <= goal if most else value >= goal})

    def vs(lanes: int, key: str = "decode"):
        return (by[lanes, "whole"].get("vs_peer") or {}).get(key) if (lanes, "whole") in by else None

    if (1, "whole") in by:
        add("decode at 1 lane, fraction of the bandwidth roofline", by[1, "whole"]["roofline_fraction"], 0.7)
    if peer in ("llama.cpp", "ik_llama.cpp"):
        on = "its GGUF file" if weights in KEPT_GGUF else "F32"
        for lanes in sorted({n for n, arm in by if arm == "whole"}):
            add(f"decode at {lanes} lane{'s' * (lanes > 1)} vs {peer} on {on}", vs(lanes), 1.0)
            add(f"prefill at {lanes} lane{'s' * (lanes > 1)} vs {peer} on {on}", vs(lanes, "prefill"), 1.0)
        if weights in KEPT_GGUF and peer == "llama.cpp":
            add("decode at 1 lane vs llama.cpp on its GGUF file (goal)", vs(1), 1.3)
        for lanes in sorted({n for n, arm in by if arm == "whole" and (n, "peer") in by}):
            mine, theirs = by[lanes, "whole"]["peak_rss_bytes"], by[lanes, "peer"]["peak_rss_bytes"]
            add(f"peak memory at {lanes} lane{'s' * (lanes > 1)} over {peer}'s", mine / theirs if theirs else None,
                1.1, most=True)
    elif peer == "hf":
        add("decode at 1 lane vs the peer", vs(1), 1.5)
        add("decode at 8 lanes vs the peer", vs(8), 3.0)
    one = by.get((1, "whole"), {}).get("step_s")
    for lanes in sorted(n for n, arm in by if arm == "whole" and n > 1):
        more = by[lanes, "whole"]["step_s"]
        add(f"decode step at 1 lane over one at {lanes} lanes", one / more if one and more else None, 1.0, most=True)
    if (8, "whole") in by:
        if (1, "whole") in by and by[1, "whole"]["decode_tokens_per_s"] and by[8, "whole"]["decode_tokens_per_s"]:
            add("aggregate decode, 8 lanes / 1 lane",
                by[8, "whole"]["decode_tokens_per_s"] / by[1, "whole"]["decode_tokens_per_s"], 4.0)
    for (lanes, arm), row in by.items():
        whole = by.get((lanes, "whole"))
        if arm == "paged" and whole and row["decode_tokens_per_s"] and whole["decode_tokens_per_s"]:
            add(f"paged / whole decode at {lanes} lanes (within 5%)",
                row["decode_tokens_per_s"] / whole["decode_tokens_per_s"], 0.95)
    return out
