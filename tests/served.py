"""A tiny model behind `tfq serve`'s app, and how the server tests talk to it and watch its state."""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import re
import time
from pathlib import Path
from typing import Callable

from serve_load import Call, fire
from tfq.plan.resolve import resolve_plan
from tfq.serve.app import Served
from tfq.serve.background import ServeOptions, build_served, serving

TINY_PLAN = str(Path(__file__).parent.parent / "plans" / "tiny.yaml")
POOL = 8  # pages of 64 rows: four streams with long prompts cannot all hold theirs, so some are preempted
NAME = "tiny"


def tiny_served(tiny_dirs, tiny_models, sets=()):
    """(plan, layout, loaded): the tiny plan on the tiny qwen2 model, with a pool small enough to preempt."""
    plan, _, layout = resolve_plan(TINY_PLAN, str(tiny_dirs["qwen2"]), [f"kv.pool={POOL}", *sets], True, None)
    return plan, layout, tiny_models["qwen2"]


def server(tiny, queue: int = 64, api_keys: tuple[str, ...] = (), served: dict | None = None, **engine_kw):
    """A fresh engine behind a fresh app, built as `tfq serve` builds it (the weights are shared; nothing else
    is); `served`: more of tfq.serve.background.ServeOptions (limits, hosts, stuck_after_s)."""
    plan, layout, loaded = tiny
    return build_served(plan, layout, loaded, NAME, ServeOptions(queue, api_keys, **(served or {})), **engine_kw)


def replies_alone(fresh: Callable[[], Served], model: str, load: list[Call]) -> list[list[dict]]:
    """Each call's reply (fire()'s records) sent alone, at once, to a server of its own from `fresh()`: the run
    alone that the replies under load are compared with."""
    out = []
    for call in load:
        with serving(fresh()) as base:
            out.append(asyncio.run(fire(base, model, [dataclasses.replace(call, delay=0.0)]))[0])
    return out


def metrics(base: str, key: str | None = None) -> dict[str, float]:
    conn = http.client.HTTPConnection(base.removeprefix("http://"))
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    text = conn.getresponse().read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(tfq_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.M)}


def eventually(check, timeout_s: float = 60):
    """check()'s first truthy value, looking again until the time is up (then its last value: the caller's asserts
    say what is wrong)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)  # between looks at the state, not instead of one


def until(base: str, state, timeout_s: float = 60, key: str | None = None) -> dict[str, float]:
    """Metrics once `state(metrics)` holds (or the time is up: the caller's asserts then say what is wrong); key:
    the server's API key, if it has one."""
    last: dict[str, float] = {}

    def look():
        last.update(metrics(base, key))
        return state(last)

    eventually(look, timeout_s)
    return last


def idle(base: str, timeout_s: float = 20, key: str | None = None) -> dict[str, float]:
    """Metrics once no stream is left (aborts land at the engine's next step)."""
    return until(base, lambda m: m["tfq_streams"] == 0, timeout_s, key)


def raw(base: str, method: str, path: str, body: bytes | None, headers: dict | None = None):
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), r.read()
