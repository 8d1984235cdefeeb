"""`tfq serve`: the OpenAI-compatible server (tfq/serve/), on uvicorn."""
from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from tfq.cli.app import app
from tfq.errors import TfqError
from tfq.threads import fix_threads


def served_name(spec: str) -> str:
    """The model's name in the API: `default` for the shipped model, else the folder's or file's name."""
    return spec if spec == "default" else Path(spec).name


@app.command()
def serve(
    plan: Optional[str] = typer.Option(None, "--plan", help="Plan YAML (default: plans/default.yaml values)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 serves other machines too."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TFQ_API_KEY",
                                          help="Refuse /v1/ requests without 'Authorization: Bearer KEY'."),
    queue: int = typer.Option(64, "--queue", help="Streams that may wait for a lane; beyond it requests get 429."),
    name: Optional[str] = typer.Option(None, "--name", help="The model's name in the API (default: 'default' or "
                                       "the checkpoint's name)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Exactly N torch threads (default: follow the "
                                          "free cores)."),
    quiet: bool = typer.Option(False, "--quiet", help="Hide the plan lines."),
) -> None:
    """Serve the model over OpenAI's API (chat completions, completions, models) with /health and /metrics.
    Every reply is the one its request gets alone."""
    import uvicorn

    from tfq.cli.plan import resolve_plan
    from tfq.engine import Engine
    from tfq.model.load import load_model
    from tfq.serve.app import Served, build_app
    from tfq.serve.loop import EngineLoop
    from tfq.serve.metrics import Metrics

    err = Console(stderr=True)
    if queue < 0:
        raise TfqError(f"--queue {queue}: give 0 or more streams")
    fix_threads(threads)
    sock = listening_socket(host, port)  # before the model loads: a taken port fails at once
    the_plan, config, layout = resolve_plan(plan, model, sets, quiet, err)
    with err.status("loading the model"):
        loaded = load_model(the_plan.model, device=layout.device, weights=the_plan.weights, tp=the_plan.tp)
    engine = Engine.from_plan(the_plan, layout, loaded)
    metrics = Metrics(layout.lanes, layout.pool_pages)
    served = Served(EngineLoop(engine, queue, metrics), loaded.tokenizer, name or served_name(the_plan.model),
                    layout.window, loaded.tokenizer.vocab_size, metrics, api_key or None)
    bound = sock.getsockname()[1]
    err.print(f"serving {served.model!r} at http://{host}:{bound}/v1 (OpenAI's API; /openapi.json, /health, /metrics)"
              + ("; API key required" if served.api_key else ""))
    # SIGTERM or Ctrl-C: uvicorn stops taking requests and lets those in flight finish (30 s at most);
    # the engine loop then aborts what is left, and the command exits 0
    server = uvicorn.Server(uvicorn.Config(build_app(served), log_level="warning", timeout_graceful_shutdown=30))
    for sig in (signal.SIGINT, signal.SIGTERM):
        # uvicorn handles the signal while it runs and sends it again once stopped, to the handler found at
        # its start: with this one, that second delivery does nothing and the command exits 0
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    err.print("stopped")


def listening_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise TfqError(f"--port {port} is not a TCP port; give 0 to 65535")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise TfqError(f"--host {host}: not an address here ({e.strerror}); give an IP such as 127.0.0.1") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        raise TfqError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
    sock.listen(2048)
    return sock
