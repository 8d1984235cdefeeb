"""Tensor parallelism across machines: ranks 1 .. N-1 of a `tp: N` model placed by Ray on a cluster's nodes (a
placement group, spread), each an actor running the rank's loop of tfq/parallel/rank_main.py; rank 0 is the process
that loads the model (a replica, or any driver on the cluster).

Unlike the ranks tfq starts on one machine (whose store and gloo stay on 127.0.0.1), these listen on the nodes'
addresses, where the cluster's other machines reach them: the messages are signed, but the activations travel
unencrypted. Run a Ray cluster on a private network, as Ray itself asks.

They talk as the ranks tfq starts itself do (tfq/parallel/ranks.py): over torch.distributed's gloo, the store on rank
0's node address, each message numbered and signed with the run's secret (handed to each actor by Ray, inside the
cluster), a rank admitted only once it proves it knows it. Rank 0 watches them as it watches its processes: one that
dies stops the group, and the next forward says so in one line. The bits are one process's: the split and its
gathers are the same whichever machine holds a shard (tests/test_ray.py runs tp 2 with each rank on its own node).

    from tfq.ray.ranks import place_on_ray
    place_on_ray()                      # after ray.init(...): groups started from now on are placed by Ray
    load_model("default", tp=2)
"""
from __future__ import annotations

import os
import secrets
import subprocess

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tfq.errors import TfqError
from tfq.parallel.ranks import SECRET_BYTES, Group, admit, listening_store, place_ranks, rank_device

PLACED_WITHIN_S = 120.0  # a placement group Ray cannot place in this long is refused in one line


@ray.remote
class Rank:
    def run(self, rank: int, world: int, store_host: str, port: int, device: str, secret: bytes) -> int:
        from tfq.parallel.rank_main import serve_rank

        serve_rank(rank, world, store_host, port, device, secret, ray.util.get_node_ip_address())
        return 0

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class Placed:
    """A rank on Ray, as tfq.parallel.ranks.Ranks watches a process: wait (an exit code), kill."""

    def __init__(self, actor, done, group, node):
        self.actor, self.done, self.group = actor, done, group
        self.node = node  # the id of the node Ray put it on (an ObjectRef): asked before it runs, as it then runs
        # until rank 0 stops it

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("tfq rank on Ray", timeout)
        try:
            return ray.get(self.done)
        except ray.exceptions.RayError:
            return 1

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 (removed with an earlier rank of the group)
            pass


def start_on_ray(world: int, device, bundle: dict[str, float]) -> tuple[Group, list[Placed]]:
    """Rank 0's end of a new group, and ranks 1 .. world-1 as actors Ray places, each holding `bundle` (Ray
    resources: {"CPU": 8}, or a custom resource that names the nodes ranks may use), spread over nodes."""
    host = ray.util.get_node_ip_address()
    store = listening_store(world, host)
    secret = secrets.token_bytes(SECRET_BYTES)
    group = placement_group([dict(bundle)] * (world - 1), strategy="SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=PLACED_WITHIN_S)
    if not ready:
        remove_placement_group(group)
        raise TfqError(f"Ray could not place {world - 1} tensor-parallel ranks of {bundle} each in "
                       f"{PLACED_WITHIN_S:.0f} s; add nodes (ray start --address) or lower tp")
    threads = os.environ.get("TFQ_THREADS", "")
    placed = []
    try:
        for r in range(1, world):
            actor = Rank.options(num_cpus=0, runtime_env={"env_vars": {"TFQ_THREADS": threads}},
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(group, r - 1)).remote()
            node = actor.node.remote()
            placed.append(Placed(actor, actor.run.remote(r, world, host, store.port, str(device), secret), group, node))
        admit(store, secret, placed)
        return Group(0, world, store, rank_device(device, 0), secret, host), placed
    except BaseException:
        for p in placed:
            p.kill()
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 (removed with a rank already: the error that matters is the one raised)
            pass
        raise


def place_on_ray(bundle: dict[str, float] | None = None) -> None:
    """Groups started from now on in this process place their ranks on the Ray cluster it is connected to, each
    rank holding `bundle` (default one CPU)."""
    chosen = dict(bundle or {"CPU": 1})

    def start(world: int, device):
        return start_on_ray(world, device, chosen)

    place_ranks(start)

