"""How many CPU threads the torch kernels use: as many as there are cores that no other process keeps busy.

With 2 threads on 2 cores and another process busy on one of them, every parallel region of a step waits
for the thread whose core is taken: measured here, one stream's decode fell from 26 to 6 tokens/s, where 1
thread ran at 15.6. So between steps, every few seconds, the engine reads how busy the other processes kept
the cores (/proc/stat less this process's own CPU time) and sets the threads to the cores left, at least 1
and at most the starting count, down when the machine is busy and back up when it frees.

A thread count is a chunking of the work, and chunkings can change bits (tfq/engine/layer_guard.py), so the policy only
moves between counts the start-up guard proved on this build: a ladder of the starting count and the powers
of two below it, each proved the first time the policy wants it (a count that fails is never used). Set
`--threads N`, TFQ_THREADS or OMP_NUM_THREADS to fix the count yourself (tfq then proves N alone).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

FIXED_VARIABLES = ("TFQ_THREADS", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class CpuSample:
    wall: float  # seconds, monotonic
    busy: float  # CPU seconds all processes spent busy, summed over cores
    own: float  # CPU seconds this process spent


def read_sample() -> CpuSample | None:
    """None where /proc/stat is not there (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    t = os.times()
    return CpuSample(time.monotonic(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
                     t.user + t.system)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fix_threads(n: int | None) -> None:
    """--threads N: exactly N torch threads (even past the cores: it is a chunking, and the bits are what the
    check is about), and no policy. None: TFQ_THREADS if set, else leave torch's count alone."""
    from tfq.errors import TfqError

    if n is None:
        text = os.environ.get("TFQ_THREADS", "").strip()
        if not text:
            return
        try:
            n = int(text)
        except ValueError:
            raise TfqError(f"TFQ_THREADS must be a whole number of threads, not {text!r}") from None
    if n < 1:
        raise TfqError(f"--threads must be at least 1, got {n}")
    torch.set_num_threads(n)
    os.environ["TFQ_THREADS"] = str(n)  # engines built later in this process keep it (Threads.auto)


def release_workers() -> bool:
    """This thread gives back its OpenMP workers (kernels/cpu/workers.cpp) and the tensors its kernels keep for
    reuse (kernels/cpu/pool.h), before another thread takes over the forwards: libgomp keeps a pool for every
    thread that ran a parallel region, and with more of them than cores its workers barely spin, so the stepping
    thread's steps slow by a third (measured: tfq serve's decode step, 34-35 ms against 24 ms). The runtime starts
    workers again if this thread computes once more. False where tfq's kernels are not loaded or the OpenMP runtime
    cannot."""
    from tfq.kernels import cpu_build

    if not cpu_build.built():
        return False
    cpu_build.op("pool_release")()
    return bool(cpu_build.op("release_workers")())


def ladder(most: int) -> list[int]:
    """The counts the policy may pick, most first: the starting count and the powers of two below it."""
    counts, n = {most}, 1
    while n < most:
        counts.add(n)
        n *= 2
    return sorted(counts, reverse=True)


class Threads:
    """Sets torch's thread count from the cores other processes leave free; `step` runs between forwards."""

    def __init__(self, most: int | None = None, every_s: float = 2.0,
                 sample: Callable[[], CpuSample | None] = read_sample, cores: int | None = None):
        self.most = most or torch.get_num_threads()
        self.every_s = every_s
        self.sample = sample
        self.cores = cores or usable_cores()
        self.last = sample()
        self.fewest = self.most  # the fewest threads used so far
        self.refused: set[int] = set()  # counts the guard refused on this build

    @classmethod
    def auto(cls) -> "Threads | None":
        """The policy, or None where the count must stay as it is (fixed by the user, or nothing to follow)."""
        if any(os.environ.get(v) for v in FIXED_VARIABLES) or torch.get_num_threads() < 2 or read_sample() is None:
            return None
        return cls()

    def step(self, proved: Callable[[int], bool]) -> None:
        """Between forwards: follow the free cores, on counts `proved` says hold on this build."""
        last = self.last
        if last is None or time.monotonic() - last.wall < self.every_s:
            return
        now = self.sample()
        if now is None or now.wall <= last.wall:
            return
        others = max(0.0, ((now.busy - last.busy) - (now.own - last.own)) / (now.wall - last.wall))
        free = max(1, min(self.most, int(self.cores - others + 0.5)))
        self.last = now
        for n in ladder(self.most):
            if n > free or n in self.refused:
                continue
            if n != torch.get_num_threads() and not proved(n):
                self.refused.add(n)
                continue
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
            self.fewest = min(self.fewest, n)
            return

    def restore(self) -> None:
        """Back to the starting count, so the next engine in this process starts where this one did."""
        torch.set_num_threads(self.most)
