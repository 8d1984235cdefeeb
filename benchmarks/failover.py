"""A replica killed mid-reply: 16 streamed chats through `tfq serve --replicas 2` on a Ray cluster on this machine,
one replica SIGKILLed at a random moment, every reply compared with the same chats on a one-process server (token
ids and logits digests), and the stall the moved streams saw.

    python benchmarks/failover.py --streams 16 --seed 0 --json failover.json

The stall of a stream is the gap between its two chunks around the kill; the ingress's /health counts the streams it
moved, and the longest stalls are theirs. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import time
import urllib.request


async def stream(client, model: str, messages: list, seed: int, max_tokens: int, moments: list, hook) -> dict:
    out = {"ids": [], "digests": [], "times": []}
    response = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.8 if seed % 2 else 0.0, seed=seed,
        stream=True, extra_body={"return_token_ids": True, "return_digests": True})
    async for chunk in response:
        now = time.perf_counter()
        for c in chunk.model_dump()["choices"]:
            out["ids"] += c.get("token_ids") or []
            out["digests"] += c.get("digests") or []
        out["times"].append(now)
        moments.append(now)
        await hook()
    return out


async def run_all(base: str, model: str, chats: list, max_tokens: int, hook=None) -> list[dict]:
    from openai import AsyncOpenAI

    async def nothing():
        return None

    moments: list[float] = []
    async with AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=1800) as client:
        return list(await asyncio.gather(*(stream(client, model, m, i, max_tokens, moments, hook or nothing)
                                           for i, m in enumerate(chats))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=["lanes=8", "window=2048"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import ray
    from ray import serve

    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.ray import ReplicaSpec, application
    from tfq.serve.background import ServeOptions, build_served, serving
    from tfq.suite import default_suite, load_prompts

    rng = random.Random(a.seed)
    prompts = load_prompts(default_suite())
    chats = [list(prompts[i % len(prompts)].messages) for i in range(a.streams)]
    plan, _, layout = resolve_plan(None, "default", a.sets, True, None)
    loaded = load_model(plan.model, progress=False, device=layout.device, weights=plan.weights)
    with serving(build_served(plan, layout, loaded, "default", ServeOptions(queue=64))) as base:
        reference = asyncio.run(run_all(base, "default", chats, a.max_tokens))
    del loaded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application(ReplicaSpec(None, "default", tuple(a.sets), "default", ServeOptions(queue=64), 1), 2),
              name="tfq", route_prefix="/")
    handle = serve.get_deployment_handle("tfq-replica", "tfq")
    pids = set()
    while len(pids) < 2:  # idle replicas share calls without a key: ask until both have answered
        pids.add(handle.facts.remote().result()["pid"])
    victim = rng.choice(sorted(pids))
    total = a.streams * a.max_tokens
    at = rng.randrange(total // 10, total // 2)  # the kill after this many chunks, all streams together
    seen, kill_time = [0], [None]

    async def hook():
        seen[0] += 1
        if seen[0] == at:
            os.kill(victim, signal.SIGKILL)
            kill_time[0] = time.perf_counter()

    base = f"http://127.0.0.1:{port}"
    got = asyncio.run(run_all(base, "default", chats, a.max_tokens, hook))
    moved = json.loads(urllib.request.urlopen(base + "/health", timeout=60).read())["moved"]
    serve.shutdown()
    ray.shutdown()

    equal = sum(g["ids"] == r["ids"] and g["digests"] == r["digests"] for g, r in zip(got, reference))
    stalls = []
    for g in got:  # the gap around the kill, for the streams in flight then
        t = g["times"]
        spans = [t[i + 1] - t[i] for i in range(len(t) - 1) if t[i] <= kill_time[0] < t[i + 1]]
        stalls += spans
    moved_stalls = sorted(stalls, reverse=True)[:moved]
    others = sorted(stalls, reverse=True)[moved:]
    gaps = [t[i + 1] - t[i] for g in got for t in [g["times"]] for i in range(len(t) - 1)]
    result = {"streams": a.streams, "max_tokens": a.max_tokens, "killed_after_chunks": at, "moved": moved,
              "equal": equal, "stall_ms_moved": {"p50": 1e3 * statistics.median(moved_stalls) if moved_stalls else None,
                                                 "max": 1e3 * max(moved_stalls) if moved_stalls else None},
              "stall_ms_others_max": 1e3 * max(others) if others else None,
              "tbt_ms_p50": 1e3 * statistics.median(gaps)}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
