"""The ranks of a tensor-parallel run: rank 0 is the process the user started (it schedules, samples, talks to
the user); tfq starts ranks 1 .. N-1 itself (`python -m tfq.parallel.rank_main`), each holding its shard of
every model rank 0 loads with `tp: N`, and running every forward rank 0 runs, on its shard, with the same
inputs.

Rank 0 sends each rank what to do as one message a time (pickled, broadcast): load a model's shard, run a
forward of a given cache, stop. Each message carries its HMAC under a secret made for the run and handed to each
rank through its stdin; a rank checks it before unpickling, so nothing else that reaches the group's sockets can
make a rank run code. The store is bound (on 127.0.0.1 only) before its port is handed out, and a rank proves it
knows the secret before rank 0 takes it in the group.

A forward's inputs are the step's tensors (tfq/batch.py); the page pool and the scheduler live on rank 0 only,
so a rank's cache is only its key/value heads, with the same rows as rank 0's (made on the first forward that
uses it, and dropped when rank 0's is). The model's gathers and the head's logits are collectives between all
ranks, in the model's own order (tfq/parallel/model.py).

Ranks 1 .. run in sessions of their own and ignore SIGINT: Ctrl-C reaches rank 0 alone, which decides when they
stop, and holds it while a forward's collectives are under way (sigint_deferred) so the group stays in step.

Collectives run on the process group's own objects (not torch.distributed's global default group), so one
process may hold groups of several sizes (the tests run world sizes 1, 2 and 3 in one session): gloo on the
CPU, NCCL on CUDA, each rank on its own device (cuda:rank).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import hmac
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from tfq.errors import TfqError

TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for a peer (a rank 0 that stopped)
SECRET_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
STOP_WAIT = datetime.timedelta(seconds=10)  # a rank that does not take the stop in this long is killed


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads: tfq.model.load.load_model's arguments, and the split."""

    spec: str
    device: str
    weights: str
    reduce: bool = False  # the all-reduce control's split (tfq/parallel/shard.py)


class Group:
    """One rank's end of the group: the collectives the model and the messages use. store: the group's
    TCPStore (rank 0's made by listening_store); secret: the run's, that every message is signed with."""

    def __init__(self, rank: int, world: int, store, device: torch.device, secret: bytes):
        self.rank, self.world, self.device, self.store, self.secret = rank, world, device, store, secret
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

    def send(self, message, timeout: datetime.timedelta | None = None) -> None:
        """Rank 0: one message to every other rank, signed (timeout: the longest each of its collectives waits;
        None: TIMEOUT)."""
        self.broadcast(sealed(self.secret, pickle.dumps(message)), timeout)

    def receive(self):
        """Ranks 1 ..: the next message rank 0 sends (TfqError, unread, when its MAC is wrong)."""
        return opened(self.secret, self.received())

    def broadcast(self, data: bytes, timeout: datetime.timedelta | None = None) -> None:
        """Rank 0: bytes to every other rank (its length, then the bytes), Ctrl-C held until both are sent."""
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        with sigint_deferred():
            _wait(self.pg.broadcast(torch.tensor([tensor.numel()], device=self.device), 0), timeout)
            _wait(self.pg.broadcast(tensor, 0), timeout)

    def received(self) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        _wait(self.pg.broadcast(size, 0))
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        _wait(self.pg.broadcast(data, 0))
        return data.cpu().numpy().tobytes()

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
        self.group, self.processes = start_group(world, device)
        self.loaded: dict[ModelSpec, object] = {}
        self.stopped = False
        atexit.register(self.stop)

    def load(self, what: ModelSpec, load_shard, progress: bool = True):
        """Every rank's shard of a model (rank 0's returned: a LoadedModel whose model is a ShardedQwen).
        load_shard(what, group, progress) -> (LoadedModel or None, the one-line problem or ""): tfq.model.load's."""
        if what not in self.loaded:
            self.group.send(("load", what))
            loaded, problem = None, "rank 0 stopped loading"
            try:
                loaded, problem = load_shard(what, self.group, progress)
            finally:  # even on Ctrl-C: the ranks wait for rank 0's answer
                with sigint_deferred():
                    problems = [p for p in self.group.agree(problem) if p]
            if problems:
                raise TfqError(problems[0])
            self.loaded[what] = loaded
        return self.loaded[what]

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                self.group.send(("stop",), STOP_WAIT)
            except Exception:  # a rank already gone, or out of step: killed below
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


def _wait(work, timeout: datetime.timedelta | None = None) -> None:
    """A collective's end; a peer that stopped (its own error printed above by it) becomes one line here."""
    try:
        work.wait() if timeout is None else work.wait(timeout)
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


def start_group(world: int, device: torch.device, **popen) -> tuple[Group, list[subprocess.Popen]]:
    """Rank 0's end of a new group, and the processes of ranks 1 .. world-1 (popen: more Popen arguments)."""
    store = listening_store(world)
    secret = secrets.token_bytes(SECRET_BYTES)
    processes: list[subprocess.Popen] = []
    try:
        for r in range(1, world):
            processes.append(start_rank(r, world, store.port, device, secret, **popen))
        admit(store, secret, processes)
        return Group(0, world, store, rank_device(device, 0), secret), processes
    except BaseException:
        for p in processes:
            p.kill()
        raise


def listening_store(world: int):
    """Rank 0's TCPStore, already listening on a free port of 127.0.0.1 (its `port`): no other process can take
    the port between its choice and the ranks' start, and no other machine can reach it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return torch.distributed.TCPStore("127.0.0.1", port, world, True, timeout=TIMEOUT, wait_for_workers=False,
                                      master_listen_fd=sock.detach())  # the store closes it


def start_rank(rank: int, world: int, port: int, device: torch.device, secret: bytes, **popen) -> subprocess.Popen:
    """`python -m tfq.parallel.rank_main`: a fresh interpreter, whatever script or shell started rank 0, in a
    session of its own (the terminal's Ctrl-C is rank 0's alone), given the secret on its stdin (not argv or the
    environment, which other users' processes may read)."""
    p = subprocess.Popen([sys.executable, "-m", "tfq.parallel.rank_main", str(rank), str(world), str(port),
                          str(device)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                         **popen)
    p.stdin.write(secret)
    p.stdin.close()
    return p


def joined_key(rank: int) -> str:
    return f"tfq/joined/{rank}"


def proof(secret: bytes, rank: int) -> bytes:
    """What rank `rank` sets at joined_key: the secret is new each run, so no other run's proof passes."""
    return hmac.new(secret, f"tfq rank {rank} joins".encode(), "sha256").digest()


def admit(store, secret: bytes, processes: list[subprocess.Popen]) -> None:
    """Wait for every rank's proof of the secret; a wrong one, or a rank that exits first, is one line."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    for rank, p in enumerate(processes, 1):
        while not store.check([joined_key(rank)]):
            try:
                code = p.wait(timeout=0.1)  # its exit, or a tenth of a second to look at the store again
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise TfqError(f"tensor-parallel rank {rank} did not join in {TIMEOUT.total_seconds() / 60:.0f} "
                                   "minutes; is the machine overloaded? try again") from None
                continue
            raise TfqError(f"tensor-parallel rank {rank} exited (code {code}) before joining; its own error, if "
                           "any, is printed above")
        if not hmac.compare_digest(store.get(joined_key(rank)), proof(secret, rank)):
            raise TfqError(f"a process that does not know this run's secret joined as tensor-parallel rank {rank} "
                           f"(store port {store.port}): refused; is another program using this port? try again")


def sealed(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, "sha256").digest() + payload


def opened(secret: bytes, data: bytes):
    """The message in `data`, unpickled only once its MAC proves rank 0 of this run sent it."""
    mac, payload = data[:MAC_BYTES], data[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(secret, payload, "sha256").digest()):
        raise TfqError("a message failed its HMAC check (not sent by this run's rank 0): refused unread; "
                       "this rank stops, start the run again")
    return pickle.loads(payload)


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C held until the block ends, then delivered to the handler it would have reached (KeyboardInterrupt
    by default): rank 0 issues a forward's collectives one by one, so an interrupt between two would leave the
    other ranks in a collective rank 0 abandoned. Off the main thread, where signals never land, or with SIGINT
    ignored or not set from Python, it does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (None, signal.SIG_IGN):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)

