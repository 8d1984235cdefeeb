"""A server in a thread of this process, on a free port: what the tests and `tfq bench serve` talk to."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from tfq.engine import Engine
from tfq.serve.app import Served, build_app
from tfq.serve.loop import EngineLoop
from tfq.serve.metrics import Metrics


def served_engine(engine: Engine, tokenizer, name: str, queue: int = 64, api_key: str | None = None) -> Served:
    """What `tfq serve` builds around an engine."""
    metrics = Metrics(engine.settings.lanes, engine.settings.pool_pages)
    return Served(EngineLoop(engine, queue, metrics), tokenizer, name, engine.settings.window,
                  tokenizer.vocab_size, metrics, api_key)


@contextmanager
def serving(served: Served, timeout_s: float = 30.0) -> Iterator[str]:
    """Run the app on 127.0.0.1 (a free port) in a thread; yields the base URL (`http://127.0.0.1:PORT`)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(served), log_level="warning", timeout_graceful_shutdown=5))
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
