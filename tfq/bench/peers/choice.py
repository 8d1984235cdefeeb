"""The bench's peer: which engine, in which process, and whether it runs beside tfq's arms or apart.

Every peer, HF transformers, llama.cpp and ik_llama.cpp, runs in a child process (tfq.bench.peers.parent_end), so a
crash of one never takes tfq down: the bench prints one line and carries on with tfq's arms. HF runs beside the arms.
When llama.cpp (or ik_llama.cpp) and tfq do not fit in memory together, it runs apart: all its rounds, every lane
count, before tfq loads its model (tfq.bench.rounds.run_apart), and its process has exited by then."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from tfq.bench.peers.parent_end import ChildPeer, PeerFailed
from tfq.bench.record import Run
from tfq.bench.settings import BenchSettings
from tfq.model.footprint import KEPT_GGUF
from tfq.plan import Layout, Plan, available_memory, human_bytes

ENGINES = {"hf": "hf", "llama.cpp": "llama.cpp", "llama.cpp-gguf": "llama.cpp", "ik_llama.cpp": "ik_llama.cpp"}
Say = Callable[[str], None]  # prints one line
Status = Callable[[str], ContextManager]  # shows what is under way while it lasts


@dataclass(frozen=True)
class Order:
    """Side by side (interleaved) or apart, and the bytes that decided it."""

    apart: bool
    tfq_bytes: int  # the plan's total and its fixed overhead: what tfq keeps
    peer_bytes: int  # the peer's GGUF file
    available_bytes: int

    @property
    def name(self) -> str:
        return "apart" if self.apart else "interleaved"

    def words(self) -> str:
        return (f"tfq's plan {human_bytes(self.tfq_bytes)} + the peer's file {human_bytes(self.peer_bytes)} "
                f"{'>' if self.apart else '<='} {human_bytes(self.available_bytes)} available")


def peer_order(tfq_bytes: int, peer_bytes: int, available_bytes: int) -> Order:
    """Apart when both engines' memory together is more than the machine has. llama.cpp maps its file and may
    repack some tensors into a copy (Q4_K on AVX2): the file's size is counted as its need, not its pages."""
    return Order(tfq_bytes + peer_bytes > available_bytes, tfq_bytes, peer_bytes, available_bytes)


@dataclass
class PeerSide:
    """One bench's peer: its engine, where and when it runs, and what the report says of it."""

    name: str
    model: str  # the plan's model spec
    say: Say
    engine: ChildPeer | None = None
    path: Path | None = None  # the GGUF file llama.cpp runs, or the checkpoint folder HF loads
    order: Order | None = None  # None: always beside the arms (HF)
    failure: str | None = None
    runs: list[Run] = field(default_factory=list)  # made apart, before tfq loaded

    @property
    def apart(self) -> bool:
        return self.order is not None and self.order.apart

    @property
    def beside(self) -> ChildPeer | None:
        """The engine that runs interleaved with tfq's arms: none when apart or failed."""
        return None if self.apart or self.failure else self.engine

    @property
    def version(self) -> str | None:
        return self.engine.version if self.engine is not None else None

    def fail(self, e: PeerFailed) -> None:
        """Its one line printed and kept for the report; the engine ended."""
        self.failure = str(e)
        self.say(self.failure)
        if self.engine is not None:
            self.engine.close()

    def load_beside(self, threads: int, progress: bool, status: Status) -> None:
        """After tfq loaded its model: the peer's engine, when it runs beside the arms."""
        if self.beside is not None:
            what = "HF transformers" if self.name == "hf" else f"{self.name} on {self.path.name}"
            with status(f"loading the peer ({what})"):
                try:
                    self.engine.load(self.path, threads)
                except PeerFailed as e:
                    self.fail(e)

    def report(self) -> dict:
        child = self.engine is not None
        return {"name": self.name, "version": self.version, "process": "child" if child else None,
                "order": self.order.name if self.order else "interleaved" if self.name == "hf" else None,
                "order_why": self.order.words() if self.order else None,
                "memory": None if self.order is None else {
                    "tfq_bytes": self.order.tfq_bytes, "peer_bytes": self.order.peer_bytes,
                    "available_bytes": self.order.available_bytes},
                "file": str(self.path) if self.path else None, "failure": self.failure,
                "rss_peak_is_per_run": self.engine.rss_peak_is_per_run if child else None}


def start_peer(settings: BenchSettings, plan: Plan, layout: Layout, say: Say, progress: bool) -> PeerSide | None:
    """Before tfq loads its model: the peer's child starts (and says its engine's version, or the one line on
    installing or building it). HF: the checkpoint folder with its fp32 weights. llama.cpp and ik_llama.cpp: the
    file is chosen (the F32 twin written once) and the order decided."""
    if settings.peer == "none":
        return None
    side = PeerSide(settings.peer, plan.model, say)
    side.engine = ChildPeer(settings.peer, ENGINES[settings.peer])
    try:
        side.engine.start()
    except PeerFailed as e:
        side.fail(e)
        return side
    if settings.peer == "hf":
        from tfq.model.source import resolve_model

        try:
            side.path = resolve_model(plan.model, progress=progress)  # with its fp32 weights, which HF loads
        except BaseException:
            side.engine.close()
            raise
        return side
    from tfq.bench.peers.llama import peer_gguf
    from tfq.model.footprint import weights_kind
    # the weights tfq will compute with (load_model's choice; were tfq's kernels to fail to build, it would
    # fall back to fp32 while the peer runs the GGUF as shipped)
    quantized = (settings.peer == "llama.cpp-gguf"
                 or weights_kind(plan.weights, plan.model, layout.device)[0] in KEPT_GGUF)
    try:
        side.path = peer_gguf(plan.model, quantized, progress, settings.peer)
    except BaseException:
        side.engine.close()
        raise
    side.order = peer_order(layout.total_bytes + layout.overhead_bytes, side.path.stat().st_size,
                            available_memory())
    return side
