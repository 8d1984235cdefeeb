"""The ranks of a tensor-parallel run: rank 0 is the process the user started (it schedules, samples, talks to
the user); tfq starts ranks 1 .. N-1 itself (`python -m tfq.parallel.rank_main`), each holding its shard of
every model rank 0 loads with `tp: N`, and running every forward rank 0 runs, on its shard, with the same
inputs.

Rank 0 sends each rank what to do as one message a time (pickled, broadcast): load a model's shard, run a
forward of a given cache, stop. A forward's inputs are the step's tensors (tfq/batch.py); the page pool and the
scheduler live on rank 0 only, so a rank's cache is only its key/value heads, with the same rows as rank 0's
(made on the first forward that uses it, and dropped when rank 0's is). The model's gathers and the head's
logits are collectives between all ranks, in the model's own order (tfq/parallel/model.py).

Collectives run on the process group's own objects (not torch.distributed's global default group), so one
process may hold groups of several sizes (the tests run world sizes 1, 2 and 3 in one session): gloo on the
CPU, NCCL on CUDA, each rank on its own device (cuda:rank).
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from tfq.errors import TfqError

TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for a peer (a rank 0 that stopped)


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads: tfq.model.load.load_model's arguments, and the split."""

    spec: str
    device: str
    weights: str
    reduce: bool = False  # the all-reduce control's split (tfq/parallel/shard.py)


class Group:
    """One rank's end of the group: the collectives the model and the messages use."""

    def __init__(self, rank: int, world: int, port: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
            self.pg = torch.distributed.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(store, rank, world, TIMEOUT)

    def gather(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """[rows, widths[rank]] from every rank -> [rows, sum(widths)], the ranks' columns in rank order (a
        copy: no arithmetic). Uneven widths travel padded to the widest."""
        wide = max(widths)
        if t.shape[1] < wide:
            t = torch.nn.functional.pad(t, (0, wide - t.shape[1]))
        parts = [torch.empty_like(t) for _ in widths]
        _wait(self.pg.allgather([parts], [t.contiguous()]))
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], 1)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (the control's split sums)."""
        t = t.contiguous()
        _wait(self.pg.allreduce([t]))
        return t

    def send(self, message) -> None:
        """Rank 0: one message to every other rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8).to(self.device)
        _wait(self.pg.broadcast(torch.tensor([data.numel()], device=self.device), 0))
        _wait(self.pg.broadcast(data, 0))

    def receive(self):
        """Ranks 1 ..: the next message rank 0 sends."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        _wait(self.pg.broadcast(size, 0))
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        _wait(self.pg.broadcast(data, 0))
        return pickle.loads(data.cpu().numpy().tobytes())

    def agree(self, problem: str) -> list[str]:
        """Every rank's problem ("" for none), after a step that can fail on one rank (loading its shard)."""
        encoded = problem.encode()[:4000]
        mine = torch.zeros(4096, dtype=torch.uint8, device=self.device)
        mine[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        _wait(self.pg.allgather([parts], [mine]))
        return [bytes(p.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for p in parts]


class Ranks:
    """Rank 0's handle on a group of `world` ranks: it starts them, sends them work, stops them at exit."""

    def __init__(self, world: int, device: torch.device):
        port = _free_port()
        # `python -m tfq.parallel.rank_main`: a fresh interpreter, whatever script or shell started rank 0
        self.processes = [subprocess.Popen([sys.executable, "-m", "tfq.parallel.rank_main", str(r), str(world),
                                            str(port), str(device)], stdout=subprocess.DEVNULL) for r in range(1, world)]
        self.group = Group(0, world, port, rank_device(device, 0))
        self.loaded: dict[ModelSpec, object] = {}
        self.stopped = False
        atexit.register(self.stop)

    def load(self, what: ModelSpec, load_shard, progress: bool = True):
        """Every rank's shard of a model (rank 0's returned: a LoadedModel whose model is a ShardedQwen).
        load_shard(what, group, progress) -> (LoadedModel or None, the one-line problem or ""): tfq.model.load's."""
        if what not in self.loaded:
            self.group.send(("load", what))
            loaded, problem = load_shard(what, self.group, progress)
            problems = [p for p in self.group.agree(problem) if p]
            if problems:
                raise TfqError(problems[0])
            self.loaded[what] = loaded
        return self.loaded[what]

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                self.group.send(("stop",))
            except Exception:  # a rank already gone: nothing left to stop
                pass
            for p in self.processes:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


_RANKS: dict[tuple[int, str], Ranks] = {}  # one group a process for each world size and device type


def ranks(world: int, device: torch.device) -> Ranks:
    key = (world, device.type)
    if key not in _RANKS or _RANKS[key].stopped:
        _RANKS[key] = Ranks(world, device)
    return _RANKS[key]


def _wait(work) -> None:
    """A collective's end; a peer that stopped (its own error printed above by it) becomes one line here."""
    try:
        work.wait()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TfqError(f"a tensor-parallel rank stopped ({first}); its own error, if any, is printed above") from None


def exit_with_parent(parent: int) -> None:
    """A rank whose rank 0 died (killed, no stop sent) would wait in a collective for TIMEOUT: leave now."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

