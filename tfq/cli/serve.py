"""`tfq serve`: the OpenAI-compatible server (tfq/serve/), on uvicorn."""
from __future__ import annotations

import signal
import socket
from typing import List, Optional

import typer
from rich.console import Console

from tfq.cli.app import app
from tfq.engine.threads import fix_threads
from tfq.errors import TfqError
from tfq.serve.guard import Limits, allowed_hosts


@app.command()
def serve(
    plan: Optional[str] = typer.Option(None, "--plan", help="Plan YAML (default: plans/default.yaml values)."),
    model: Optional[str] = typer.Option(None, "--model", help="default, an HF folder or a .gguf file."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 serves other machines too."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one)."),
    api_keys: List[str] = typer.Option([], "--api-key", envvar="TFQ_API_KEY",
                                       help="Refuse /v1/ and /metrics requests without 'Authorization: Bearer KEY'. "
                                       "Give it again for more keys: each key is then a tenant whose prompts "
                                       "share prefix-cache pages with no other key's."),
    queue: int = typer.Option(64, "--queue", help="Streams that may wait for a lane; beyond it requests get 429."),
    name: Optional[str] = typer.Option(None, "--name", help="The model's name in the API (default: 'default' or "
                                       "the checkpoint's name)."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (after TFQ_* variables)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Exactly N torch threads (default: follow the "
                                          "free cores)."),
    quiet: bool = typer.Option(False, "--quiet", help="Hide the plan lines."),
    max_body_bytes: int = typer.Option(Limits.body_bytes, "--max-body-bytes", help="Refuse a request body over this "
                                       "many bytes (413), before reading or parsing it."),
    max_prompt_tokens: int = typer.Option(0, "--max-prompt-tokens", help="Refuse a prompt over this many tokens "
                                          "(400); 0: what the window leaves for a reply."),
    max_stop_chars: int = typer.Option(Limits.stop_chars, "--max-stop-chars", help="Refuse a stop string over this "
                                       "many characters (400)."),
    extra_hosts: List[str] = typer.Option([], "--allowed-host", help="A Host name to answer besides the defaults "
                                            "(a loopback --host answers only localhost, 127.0.0.1 and ::1)."),
    stuck_after: Optional[float] = typer.Option(None, "--stuck-after", help="Seconds one engine step may always run "
                                                "(default 300), or 10 times what its rows should take by the cost of "
                                                "steps learned here if longer, before the server calls the engine "
                                                "stuck: /health says 503 and the server exits 1."),
    log_level: str = typer.Option("warning", "--log-level", help="debug (every admission), info (finishes, "
                                  "preemptions, aborts, refusals), warning (failed streams), error (faults)."),
    log_prompts: bool = typer.Option(False, "--log-prompts", help="Log each request's prompt text (at info)."),
    receipt_key: Optional[str] = typer.Option(None, "--receipt-key", help="A file holding a secret (16 bytes or "
                                              "more) that signs every receipt (an HMAC); `tfq replay --key` checks "
                                              "it."),
    ray_address: Optional[str] = typer.Option(None, "--ray", help="Serve on Ray (pip install 'tfq[ray]'): 'local' "
                                              "(a new cluster on this machine), 'auto' (the one `ray start` runs "
                                              "here) or a cluster's address; docs/scale-out.md."),
    replicas: int = typer.Option(0, "--replicas", help="Engine replicas behind one ingress, on Ray (implies --ray "
                                 "local); each takes traffic after its self-check gives the same bits."),
) -> None:
    """Serve the model over OpenAI's API (chat completions, completions, models) with /health and /metrics.
    Every reply is the one its request gets alone."""
    from tfq.model.load import load_model
    from tfq.plan.resolve import resolve_plan
    from tfq.receipts.receipt import read_key
    from tfq.serve.background import ServeOptions, build_served, served_name, uvicorn_server
    from tfq.serve.loop import STUCK_AFTER_S

    err = Console(stderr=True)
    if queue < 0:
        raise TfqError(f"--queue {queue}: give 0 or more streams")
    for flag, value in (("--max-body-bytes", max_body_bytes), ("--max-stop-chars", max_stop_chars),
                        ("--stuck-after", 1 if stuck_after is None else stuck_after)):
        if value <= 0:
            raise TfqError(f"{flag} {value}: give a positive number")
    if max_prompt_tokens < 0:
        raise TfqError(f"--max-prompt-tokens {max_prompt_tokens}: give 0 (the window) or a positive number")
    key = read_key(receipt_key, "--receipt-key")
    start_logging(log_level)
    limits = Limits(max_body_bytes, max_prompt_tokens, max_stop_chars)
    if ray_address is not None or replicas:
        options = ServeOptions(queue, tuple(k for k in api_keys if k), limits, None, log_prompts,
                               stuck_after or STUCK_AFTER_S, key)
        return serve_on_ray(ray_address, replicas, dict(plan=plan, model=model, sets=tuple(sets), name=name,
                                                        options=options, threads=threads), host, port,
                            allowed_hosts(host, tuple(extra_hosts)), err)
    fix_threads(threads)
    sock = listening_socket(host, port)  # before the model loads: a taken port fails at once
    the_plan, config, layout = resolve_plan(plan, model, sets, quiet, err)
    with err.status("loading the model"):
        loaded = load_model(the_plan.model, device=layout.device, weights=the_plan.weights, tp=the_plan.tp)
    served = build_served(the_plan, layout, loaded, name or served_name(the_plan.model), ServeOptions(
        queue, tuple(k for k in api_keys if k), limits, allowed_hosts(host, tuple(extra_hosts)), log_prompts,
        stuck_after or STUCK_AFTER_S, key))
    bound = sock.getsockname()[1]
    err.print(f"serving {served.model!r} at http://{host}:{bound}/v1 (OpenAI's API; /openapi.json, /health, /metrics)"
              + ("; API key required" if served.api_keys else ""))
    # SIGTERM or Ctrl-C: uvicorn stops taking requests and lets those in flight finish (30 s at most);
    # the engine loop then aborts what is left, and the command exits 0
    server = uvicorn_server(served, graceful_s=30)
    for sig in (signal.SIGINT, signal.SIGTERM):
        # uvicorn handles the signal while it runs and sends it again once stopped, to the handler found at
        # its start: with this one, that second delivery does nothing and the command exits 0
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if served.loop.dead:  # never serve "ok" with a dead engine: a supervisor sees the exit and restarts
        typer.echo(f"tfq serve: the engine stopped ({served.loop.dead}); exiting", err=True)
        raise typer.Exit(1)
    err.print("stopped")


def serve_on_ray(address: str | None, replicas: int, spec: dict, host: str, port: int, hosts, err: Console) -> None:
    """`tfq serve --ray`: the same app on `replicas` replicas behind Ray Serve's proxy (tfq/ray); `spec`: what each
    replica builds (tfq.ray.ReplicaSpec's fields); hosts: the Host names the ingress answers."""
    if replicas < 0 or (address is not None and not address.strip()):
        raise TfqError(f"--replicas {replicas} --ray {address!r}: give 1 or more replicas and an address, 'auto' or "
                       f"'local'")
    try:
        import tfq.ray as on_ray
    except ImportError as e:
        raise TfqError(f"--ray needs Ray Serve ({e.msg}); install it with pip install 'tfq[ray]'") from None
    if not 0 < port < 65536:
        raise TfqError(f"--port {port}: Ray Serve's proxy needs a port from 1 to 65535")
    where = None if address in (None, "local") else address
    count = max(replicas, 1)
    err.print(f"starting {count} replica(s) on Ray ({address or 'local'}); each joins after its self-check")
    on_ray.run(on_ray.ReplicaSpec(**spec), count, where, host, port, hosts, on_ready=lambda: err.print(
        f"serving at http://{host}:{port}/v1 on Ray, {count} replica(s) (/health says which bits they were checked "
        f"against); Ctrl-C stops"))
    err.print("stopped")


def start_logging(level: str) -> None:
    """tfq's loggers (one a layer: tfq.engine.scheduler, tfq.engine.core, tfq.serve.*) to stderr, one line an event."""
    import logging

    name = level.strip().upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise TfqError(f"--log-level {level}: give debug, info, warning or error")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tfq")
    root.handlers[:] = [handler]
    root.setLevel(name)
    root.propagate = False



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
