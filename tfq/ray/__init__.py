"""tfq on Ray: replicas of the one-process server behind one ingress (docs/scale-out.md).

    from tfq.ray import ReplicaSpec, application
    serve.run(application(ReplicaSpec(model="default"), replicas=2))

`application` gives the Ray Serve app that `tfq serve --ray` runs, for users who compose their own: an ingress
(tfq/ray/ingress.py) in front of `replicas` engine replicas (tfq/ray/replica.py), each of which takes traffic only
after its self-check (tfq/ray/selfcheck.py), routed by the prompt's first full page and by load (tfq/ray/router.py).
Ray is an optional extra: `pip install 'tfq[ray]'`.
"""
from __future__ import annotations

import dataclasses
import socket
import threading

from tfq.errors import TfqError
from tfq.ray.replica import Replica, ReplicaSpec
from tfq.serve.background import ServeOptions

__all__ = ["ReplicaSpec", "application", "refusal_of", "run"]


def refusal_of(app: str, error: Exception) -> str:
    """Why Serve app `app` failed to deploy, in one line: the line a replica refused with (its self-check names chat,
    step and node), read from Ray Serve's status of the app's deployments, else Serve's own report."""
    from ray import serve

    messages = [d.message for d in serve.status().applications[app].deployments.values()] \
        if app in serve.status().applications else []
    for message in messages:
        lines = [ln for ln in message.splitlines() if "TfqError: " in ln]
        if lines:
            return lines[-1].split("TfqError: ", 1)[1].strip()
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


def application(spec: ReplicaSpec, replicas: int, cpus: float = 0, hosts: frozenset[str] | None = None):
    """The ingress bound to `replicas` replicas of `spec`, each holding `cpus` of a node's CPUs (Ray places replicas
    by them: a node's cores each, to spread them one a node); the ingress answers the Host names `hosts` (None:
    any) and holds no key (the replicas check them)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tfq.ray.ingress import Ingress
    from tfq.ray.router import PrefixRouter

    # a replica refused by its self-check fails the same way again: few retries
    engines = serve.deployment(Replica, name="tfq-replica", num_replicas=replicas, max_ongoing_requests=256,
                               ray_actor_options={"num_cpus": cpus}, health_check_period_s=2,
                               max_constructor_retry_count=3,
                               request_router_config=RequestRouterConfig(request_router_class=PrefixRouter))
    keyless = dataclasses.replace(spec, options=ServeOptions(), harm=None)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engines.bind(spec), keyless, hosts)


def run(spec: ReplicaSpec, replicas: int, address: str | None, host: str, port: int,
        hosts: frozenset[str] | None = None, on_ready=None) -> None:
    """`tfq serve --ray`: join the cluster at `address` (`auto`, an address, or None: a new one on this machine,
    on its loopback address), serve the application on host:port through Ray Serve's proxy until interrupted, then
    take it down (and the cluster, if it was ours)."""
    import ray
    from ray import serve

    free_port(host, port)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 **({"_node_ip_address": "127.0.0.1"} if address is None else {}))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise TfqError(f"--ray {address}: no Ray cluster to join there ({str(e).strip().splitlines()[0]}); start one "
                       f"with `ray start --head`, or give --ray local") from None

    def down() -> None:
        serve.delete("tfq") if address is not None else serve.shutdown()  # a shared cluster keeps its other apps
        ray.shutdown()

    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(application(spec, replicas, hosts=hosts), name="tfq", route_prefix="/", blocking=False)
    except RuntimeError as e:  # a replica that could not start: its own line (a refusal names chat, step, node)
        line = refusal_of("tfq", e)
        down()
        raise TfqError(line) from None
    if on_ready is not None:
        on_ready()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        down()


def free_port(host: str, port: int) -> None:
    """One line now, rather than a failure inside Ray Serve's proxy, for an address or port this machine cannot
    listen on."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise TfqError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
