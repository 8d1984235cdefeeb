"""The ranks of a tensor-parallel run: rank 0 is the process the user started (it schedules, samples, talks to
the user); tfq starts ranks 1 .. N-1 itself (`python -m tfq.parallel.rank_main`), each holding its shard of
every model rank 0 loads with `tp: N`, and running every forward rank 0 runs, on its shard, with the same
inputs.

Rank 0 sends each rank what to do as one message a time (pickled, broadcast): load a model's shard, run a
forward of a given cache, stop. Each message is numbered and signed (HMAC) under a secret made for the run and
handed to each rank through its stdin: first a fixed-size header (its length and number, signed), then the
payload (signed with its number). A rank checks the header before it allocates anything from the length, takes
each number once and in order (a replayed forward would write stale keys and values), and checks the payload
before unpickling it, so nothing else that reaches the group's sockets can make a rank run code or allocate.
The store is bound (on 127.0.0.1 only) before its port is handed out, gloo's connections stay on 127.0.0.1 (all
ranks run on this machine; TFQ_TP_INTERFACE names another interface), and a rank proves it knows the secret
before rank 0 takes it in the group. Ranks may instead be placed on other machines by Ray (tfq/ray/ranks.py,
`place_ranks`): the store and gloo then use the nodes' addresses, and the rest is the same.

A forward's inputs are the step's tensors (tfq/engine/batch.py); the page pool and the scheduler live on rank 0 only,
so a rank's cache is only its key/value heads, with the same rows as rank 0's (made on the first forward that
uses it, and dropped when rank 0's is). The model's gathers and the head's logits are collectives between all
ranks, in the model's own order (tfq/parallel/model.py).

Ranks 1 .. run in sessions of their own and ignore SIGINT: Ctrl-C reaches rank 0 alone, which decides when they
stop, and holds it while a forward's collectives are under way (sigint_deferred) so the group stays in step. Any
other fault on rank 0 inside a forward leaves the ranks in a collective rank 0 abandoned: the group is torn down
(Group.in_step), and everything it is asked after that is refused in one line; loading the model again starts a
new group.

Collectives run on the process group's own objects (not torch.distributed's global default group), so one
process may hold groups of several sizes (the tests run world sizes 1, 2 and 3 in one session): gloo on the
CPU, NCCL on CUDA, each rank on its own device (cuda:rank).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import hmac
import logging
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

from tfq.errors import TfqError, Unservable
from tfq.parallel.sealing import HEAD_BYTES, MAC_BYTES, MAX_MESSAGE, header, opened, read_header, sealed

log = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for a peer (a rank 0 that stopped)
SECRET_BYTES = 32
STOP_WAIT = datetime.timedelta(seconds=10)  # a rank that does not take the stop in this long is killed
INTERFACE = "TFQ_TP_INTERFACE"  # names the network interface gloo uses instead of 127.0.0.1


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

    def __init__(self, rank: int, world: int, store, device: torch.device, secret: bytes, host: str | None = None):
        """host: the address gloo uses on this rank's machine (None: gloo_device's choice, this machine's own)."""
        self.rank, self.world, self.device, self.store, self.secret = rank, world, device, store, secret
        self.sent = self.heard = 0  # the number of the last message rank 0 sent, and of the last this rank took
        self.broken = ""  # why the group was torn down ("" while it is in step)
        self.on_torn_down = lambda: None  # rank 0's Ranks stops the processes
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
            self.pg = torch.distributed.ProcessGroupNCCL(store, rank, world)
        else:
            options = torch.distributed.ProcessGroupGloo._Options()
            options._devices, options._timeout, options._threads = [gloo_device(host)], TIMEOUT, 2
            self.pg = torch.distributed.ProcessGroupGloo(store, rank, world, options)

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
        """Rank 0: one message to every other rank, numbered and signed (timeout: the longest each of its
        collectives waits; None: TIMEOUT). Refused in one line once the group is torn down."""
        if self.broken:
            raise Unservable(f"the tensor-parallel group was torn down after a fault on rank 0 left its ranks out of "
                           f"step ({self.broken}); load the model again, or restart tfq")
        payload = pickle.dumps(message)
        if len(payload) > MAX_MESSAGE:
            raise TfqError(f"a message to the tensor-parallel ranks of {len(payload)} bytes is over the "
                           f"{MAX_MESSAGE} a rank takes; lower prefill_chunk or step_tokens")
        self.sent += 1
        self.broadcast([header(self.secret, self.sent, len(payload)), sealed(self.secret, self.sent, payload)],
                       timeout)

    def receive(self):
        """Ranks 1 ..: the next message rank 0 sends (TfqError, unread, when its MAC or number is wrong)."""
        length = read_header(self.secret, self.heard + 1, self.received(HEAD_BYTES))
        message = opened(self.secret, self.heard + 1, self.received(MAC_BYTES + length))
        self.heard += 1
        return message

    def broadcast(self, parts: list[bytes], timeout: datetime.timedelta | None = None) -> None:
        """Rank 0: byte strings to every other rank, one broadcast each, Ctrl-C held until all are sent."""
        with sigint_deferred():
            for data in parts:
                _wait(self.pg.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), 0),
                      timeout)

    def received(self, size: int) -> bytes:
        """Ranks 1 ..: the next `size` bytes rank 0 broadcasts (size: fixed, or read from a checked header)."""
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        _wait(self.pg.broadcast(data, 0))
        return data.cpu().numpy().tobytes()

    @contextlib.contextmanager
    def in_step(self):
        """Rank 0: a message and the collectives that follow it (a forward), with Ctrl-C held to the end. Any
        fault inside leaves the other ranks waiting in a collective rank 0 will not join, and the next message
        would meet them there (a hang, or bytes read as the wrong thing): so the group is torn down first."""
        with sigint_deferred():
            try:
                yield
            except Unservable:  # torn down already
                raise
            except BaseException as e:
                self.tear_down(f"{type(e).__name__}: {_first_line(e)}")
                if isinstance(e, Exception):  # an interrupt stays one
                    raise Unservable(f"a fault on rank 0 tore the tensor-parallel group down ({self.broken}); load "
                                     f"the model again, or restart tfq") from e
                raise

    def tear_down(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            self.on_torn_down()

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

    def __init__(self, world: int, device: torch.device, start=None):
        """start(world, device) -> (rank 0's Group, the other ranks as processes to watch, kill and wait on):
        start_group's processes on this machine by default."""
        self.group, self.processes = (start or start_group)(world, device)
        self.group.on_torn_down = self.kill
        self.loaded: dict[ModelSpec, object] = {}
        self.stopped = False
        atexit.register(self.stop)
        for rank, p in enumerate(self.processes, 1):
            threading.Thread(target=self._watch, args=(rank, p), daemon=True, name=f"tfq rank {rank}").start()

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        """A rank that exits unasked leaves the others in a collective rank 0 may wait on through live peers (a
        ring passes the loss on only as far as a peer that reads from it; one run waited out gloo's 30 minutes):
        the rest are stopped too, so whatever rank 0 waits on fails at once, and its next forward says so."""
        code = p.wait()
        if not self.stopped:
            log.error("tensor-parallel rank %d exited (%s); stopping the group", rank, code)
            self.kill()

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

    def kill(self) -> None:
        """The ranks stopped at once: they wait in a collective rank 0 left, and can take no message."""
        self.stopped = True  # ranks() starts a new group for the next load
        for p in self.processes:
            p.kill()
            p.wait()

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


_RANKS: dict[tuple, Ranks] = {}  # one group a process for each world size, device type and placement
_PLACE: list = [None]  # how ranks 1 .. start: None for start_group's processes here, or place_ranks' function


def place_ranks(start) -> None:
    """Where the ranks of the groups started from now on run: start(world, device) -> (Group, processes), as
    start_group (None: start_group, this machine); tfq/ray/ranks.py places them on a Ray cluster's nodes."""
    _PLACE[0] = start


def ranks(world: int, device: torch.device) -> Ranks:
    key = (world, device.type, _PLACE[0])
    if key not in _RANKS or _RANKS[key].stopped:
        _RANKS[key] = Ranks(world, device, _PLACE[0])
    return _RANKS[key]


def _wait(work, timeout: datetime.timedelta | None = None) -> None:
    """A collective's end; a peer that stopped (its own error printed above by it) becomes one line here."""
    try:
        work.wait() if timeout is None else work.wait(timeout)
    except RuntimeError as e:
        raise TfqError(f"a tensor-parallel rank stopped ({_first_line(e)}); its own error, if any, is printed "
                       "above") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def gloo_device(host: str | None = None):
    """gloo's end on `host` where given (a Ray node's address), else on 127.0.0.1, or on the interface
    TFQ_TP_INTERFACE names: not where the hostname resolves (gloo's default), nor where GLOO_SOCKET_IFNAME points
    for other jobs; every rank runs on this machine."""
    if host:
        return torch.distributed.ProcessGroupGloo.create_device(hostname=host)
    interface = os.environ.get(INTERFACE, "").strip()
    if not interface:
        return torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    try:
        return torch.distributed.ProcessGroupGloo.create_device(interface=interface)
    except RuntimeError as e:
        raise TfqError(f"{INTERFACE}={interface}: gloo cannot use it ({_first_line(e)}); name an interface with an "
                       "address (ip addr lists them), or unset it to keep the ranks on 127.0.0.1") from None


def exit_with_parent(parent: int) -> None:
    """A rank whose rank 0 died (killed, no stop sent) would wait in a collective for TIMEOUT: leave now."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def start_group(world: int, device: torch.device, **popen) -> tuple[Group, list[subprocess.Popen]]:
    """Rank 0's end of a new group, and the processes of ranks 1 .. world-1 (popen: more Popen arguments)."""
    if device.type != "cuda":
        gloo_device()  # a bad TFQ_TP_INTERFACE is one line here, before any rank starts
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


def listening_store(world: int, host: str = "127.0.0.1"):
    """Rank 0's TCPStore, already listening on a free port of `host` (its `port`): no other process can take the
    port between its choice and the ranks' start; on 127.0.0.1 (the default) no other machine can reach it."""
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return torch.distributed.TCPStore(host, port, world, True, timeout=TIMEOUT, wait_for_workers=False,
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

