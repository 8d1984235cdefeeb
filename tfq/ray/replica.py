"""One tfq engine as a Ray Serve replica: the one-process server's app (tfq/serve/app.py, built by `build_served`),
driven in the replica's own event loop by the requests the ingress relays, so every route, refusal and stream is
the one `tfq serve` gives. It takes traffic only after its self-check (tfq/ray/selfcheck.py).
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from tfq.ray.selfcheck import check, refuse, where_am_i
from tfq.serve.background import ServeOptions


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds, as `tfq serve` takes it: plan file, model, --set overrides, the API's model name,
    how it serves (queue, keys, limits; Host names are the proxy's to check), torch threads."""

    plan: str | None = None
    model: str | None = None
    sets: tuple[str, ...] = ()
    name: str | None = None
    options: ServeOptions = ServeOptions()
    threads: int | None = 1
    harm: Callable | None = field(default=None, compare=False)  # a check's control: applied to the loaded model
    # before the self-check, to make this replica's bits differ (production leaves it None)


@dataclass(frozen=True)
class Head:
    """A relayed response's status line and headers, sent before its body."""

    status: int
    headers: list[tuple[str, str]]


class Replica:
    def __init__(self, spec: ReplicaSpec):
        from rich.console import Console

        from tfq.engine.threads import fix_threads
        from tfq.model.load import load_model
        from tfq.plan.resolve import resolve_plan
        from tfq.serve.app import build_app
        from tfq.serve.background import build_served, served_name

        fix_threads(spec.threads)
        plan, _, layout = resolve_plan(spec.plan, spec.model, list(spec.sets), True, Console(stderr=True, quiet=True))
        if plan.tp > 1:  # the replica is rank 0; Ray places its other ranks (tfq/ray/ranks.py)
            from tfq.ray.ranks import place_on_ray

            place_on_ray()
        loaded = load_model(plan.model, progress=False, device=layout.device, weights=plan.weights, tp=plan.tp)
        if spec.harm is not None:
            spec.harm(loaded)
        name = spec.name or served_name(plan.model)
        self.verdict = check(plan, layout, loaded)
        refuse(self.verdict)
        self.page_rows = layout.page_rows
        self.served = build_served(plan, layout, loaded, name, spec.options)
        self.app = build_app(self.served)
        self.served.loop.start()

    def facts(self) -> dict:
        """What the ingress routes by, what the self-check compared with, and which replica this is (its id as the
        router ranks it, its node and process)."""
        from ray import serve

        return {"page_rows": self.page_rows, "reference": self.verdict.reference, "model": self.served.model,
                "where": where_am_i(), "replica": serve.get_replica_context().replica_id.unique_id,
                "pid": os.getpid()}

    def check_health(self) -> None:  # Ray Serve's health check: a dead engine loop makes the replica unhealthy
        if self.served.loop.dead:
            raise RuntimeError(f"the engine stopped: {self.served.loop.dead}")

    async def relay(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                    route: str | None = None) -> AsyncIterator[Head | bytes]:
        """One HTTP request through the app: its Head, then its body's chunks as the app sends them. `route` is the
        router's (tfq/ray/router.py). The caller going away is the client going away: the app aborts its stream."""
        from tfq.serve.guard import replay

        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def disconnect() -> dict:  # what the client's side says after the body: only that it went away
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await out.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        task = asyncio.create_task(self.app(scope, replay(body, disconnect), send))
        task.add_done_callback(lambda _: out.put_nowait(None))  # after every message the app sent
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    yield Head(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                   for k, v in message.get("headers", [])])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
            task.result()  # the app ended without a whole response: raise what it raised
        finally:
            gone.set()
