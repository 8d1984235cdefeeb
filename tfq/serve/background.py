"""Building a server around an engine, and running it: what `tfq serve`, the tests and `tfq bench serve` share."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tfq.engine.core import Engine
from tfq.errors import TfqError
from tfq.receipts.receipt import Issuer
from tfq.serve.app import Served, build_app
from tfq.serve.guard import Limits
from tfq.serve.loop import STUCK_AFTER_S, EngineLoop
from tfq.serve.metrics import Metrics


@dataclass(frozen=True)
class ServeOptions:
    """How `tfq serve` serves, besides the model: the engine loop's queue and stuck timeout, and the app's keys,
    limits, Host names and prompt logging (tfq.serve.intake.Served)."""

    queue: int = 64
    api_keys: tuple[str, ...] = ()
    limits: Limits = Limits()
    hosts: frozenset[str] | None = None
    log_prompts: bool = False
    stuck_after_s: float = STUCK_AFTER_S
    receipt_key: bytes | None = None  # signs every receipt (an HMAC), so its issuer can vouch for it


def served_name(spec: str) -> str:
    """The model's name in the API: `default` for the shipped model, a hub model's hub name, else the folder's or
    file's name."""
    from tfq.model.hub import hub_name

    return spec if spec == "default" else (hub_name(spec) or Path(spec).name).split(":")[0]


def build_served(plan, layout, loaded, name: str, options: ServeOptions = ServeOptions(), **engine_kw) -> Served:
    """What `tfq serve` serves, from its plan (tfq.plan.Plan and its Layout) and loaded model: the engine, its
    loop and metrics, the app's settings. The CLI, `tfq bench serve` and the tests all build it here; engine_kw
    reach Engine.from_plan (a check's controls: controls=tfq.engine.core.Controls(...))."""
    engine = Engine.from_plan(plan, layout, loaded, **engine_kw)
    try:
        engine.grammars  # llguidance's view of the tokenizer (about a second), now rather than in a request
    except TfqError:
        pass  # no llguidance: a constrained request is refused with that reason
    metrics = Metrics(engine.settings.lanes, engine.settings.pool_pages)
    o = options
    return Served(EngineLoop(engine, o.queue, metrics, o.stuck_after_s), loaded.tokenizer, name,
                  engine.settings.window, loaded.tokenizer.vocab_size, metrics, tuple(o.api_keys), o.limits, o.hosts,
                  o.log_prompts, Issuer.of(plan, layout, loaded, o.receipt_key))


def uvicorn_server(served: Served, graceful_s: float):
    """uvicorn around the app; an engine that cannot serve any more stops it (the caller then exits non-zero)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(served), log_level="warning",
                                           timeout_graceful_shutdown=graceful_s))
    served.loop.on_dead = lambda _: setattr(server, "should_exit", True)
    return server


@contextmanager
def serving(served: Served, timeout_s: float = 30.0) -> Iterator[str]:
    """Run the app on 127.0.0.1 (a free port) in a thread; yields the base URL (`http://127.0.0.1:PORT`)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn_server(served, graceful_s=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
