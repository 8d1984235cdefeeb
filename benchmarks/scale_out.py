"""One `tfq serve` beside `tfq serve --replicas N` on a Ray cluster on this machine: requests/s, TTFT and TBT (p50,
p99) at each concurrency, on the shipped suite's chats, every reply compared with the chat's reply alone.

    python benchmarks/scale_out.py --replicas 2 --concurrency 8,16 --json scale_out.json

The one-process server is `tfq bench serve`'s (a fresh server a level, tfq/bench/serve.py); the replicas are one
Ray app (tfq/ray) started once, its replicas a thread each unless `--threads` says otherwise. The reference is each
chat alone on the one-process server. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a replica")
    ap.add_argument("--set", dest="sets", action="append", default=["lanes=8", "window=2048"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import ray
    from ray import serve
    from rich.console import Console
    from rich.table import Table

    from tfq.bench.serve import ServeSettings, Target, drive, fitting_chats, level_figures, run_levels, tfq_level
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.ray import ReplicaSpec, application
    from tfq.serve.background import ServeOptions, served_name
    from tfq.suite import default_suite, load_prompts

    console = Console()
    levels = tuple(int(c) for c in a.concurrency.split(","))
    settings = ServeSettings(levels, None, a.max_tokens)
    plan, _, layout = resolve_plan(None, a.model, a.sets, True, None)
    loaded = load_model(plan.model, progress=False, device=layout.device, weights=plan.weights)
    name = served_name(plan.model)
    chats = fitting_chats(load_prompts(default_suite()), loaded.tokenizer, layout.window, a.max_tokens)[0]
    one, reference = run_levels(tfq_level(Target(plan, layout, loaded, name)), chats,
                                ServeSettings((*levels, 1), None, a.max_tokens), who="one process: ")
    one = [lv for lv in one if lv.concurrency != 1]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.perf_counter()
    spec = ReplicaSpec(None, a.model, tuple(a.sets), name, ServeOptions(queue=64), a.threads)
    serve.run(application(spec, a.replicas), name="tfq", route_prefix="/")
    started = time.perf_counter() - t0
    base = f"http://127.0.0.1:{port}"
    replicated = [asyncio.run(drive(base, name, chats, settings.requests_at(c), c, a.max_tokens, lambda: None))
                  for c in levels]
    serve.shutdown()
    ray.shutdown()

    rows = [("one tfq serve", lv) for lv in one] + [(f"--replicas {a.replicas}", lv) for lv in replicated]
    figures = [{"server": who, **level_figures(lv, chats, reference)} for who, lv in rows]
    table = Table(title=f"{name}: one server beside {a.replicas} replicas on Ray ({a.max_tokens} tokens a reply)")
    for col in ("server", "concurrency", "requests/s", "TTFT p50 / p99 ms", "TBT p50 / p99 ms", "equal"):
        table.add_column(col)
    for f in figures:
        table.add_row(f["server"], str(f["concurrency"]), f"{f['requests_per_s']:.2f}",
                      f"{f['ttft_ms']['p50']:.0f} / {f['ttft_ms']['p99']:.0f}",
                      f"{f['tbt_ms']['p50']:.0f} / {f['tbt_ms']['p99']:.0f}",
                      f"{f['equal_replies']}/{f['requests']}")
    console.print(table)
    console.print(f"the Ray app started in {started:.0f} s (replicas loaded and self-checked)")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"replicas": a.replicas, "threads_a_replica": a.threads, "ray_start_s": started,
                       "levels": [{k: v for k, v in f.items() if k != "per_request"} for f in figures]}, out, indent=1)


if __name__ == "__main__":
    main()
