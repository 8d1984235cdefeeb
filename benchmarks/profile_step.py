"""Where a decode step's time goes: the torch profiler over a few steps of the engine, by op and by kind.

    python benchmarks/profile_step.py --lanes 1,8 --steps 8

Each lane count gets its own engine on the default model (whole plan, 128-token prompts of random ids). The
prompts are prefilled and one step runs as a warm-up; `--steps` decode steps are timed without the profiler,
then as many run under it.
It prints the ops that take the most CPU time, and one line per lane count that splits a step into linear
layers (oneDNN), attention (bmm items and the softmax around them), and the rest (elementwise ops,
indexing, Python). `--json FILE` writes the same as JSON. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

LINEAR = ("mkldnn::_linear_pointwise",)
ATTENTION = ("aten::bmm", "aten::masked_fill", "aten::amax", "aten::cummax", "aten::addcmul", "aten::index_select")


def kind(name: str) -> str:
    if name in LINEAR:
        return "linear"
    if name in ATTENTION:
        return "attention"
    return "rest"


def profile_lanes(loaded, lanes: int, steps: int, prompt_tokens: int) -> dict:
    from tfq.engine import Engine, EngineSettings
    from tfq.stream import Request

    g = torch.Generator().manual_seed(lanes)
    vocab = loaded.config.vocab_size
    engine = Engine(loaded.model, EngineSettings(window=prompt_tokens + 2 * steps + 8, lanes=lanes), eos_ids=())
    for _ in range(lanes):
        engine.add(Request(tuple(torch.randint(100, vocab - 1000, (prompt_tokens,), generator=g).tolist()),
                           max_tokens=2 * steps + 2))
    engine.step()  # every prompt prefilled, first tokens drawn
    engine.step()  # warm-up decode
    t0 = time.perf_counter()  # the step's wall time without the profiler, whose own cost is large at 1 lane
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    split = {"linear": 0.0, "attention": 0.0}
    for e in events:
        k = kind(e.key)
        if k != "rest":
            split[k] += e.self_cpu_time_total / 1e3 / steps
    split["rest"] = max(0.0, wall * 1e3 - split["linear"] - split["attention"])
    return {"lanes": lanes, "step_ms": round(wall * 1e3, 2), "split_ms": {k: round(v, 2) for k, v in split.items()},
            "top_ops": [{"op": e.key, "calls_per_step": e.count // steps,
                         "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2)} for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tfq.model.load import load_model

    loaded = load_model("default", progress=False)
    results = [profile_lanes(loaded, int(n), a.steps, a.prompt_tokens) for n in a.lanes.split(",")]
    for r in results:
        s = r["split_ms"]
        print(f"lanes {r['lanes']}: {r['step_ms']:.1f} ms a step = linear {s['linear']:.1f} + attention "
              f"{s['attention']:.1f} + rest {s['rest']:.1f} (threads {torch.get_num_threads()})")
        for op in r["top_ops"][:8]:
            print(f"    {op['op']:<36} {op['calls_per_step']:>5} calls {op['self_ms_per_step']:>8.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
