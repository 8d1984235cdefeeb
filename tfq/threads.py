"""How many CPU threads the torch kernels use: as many as there are cores that no other process keeps busy.

With 2 threads on 2 cores and another process busy on one of them, every parallel region of a step waits
for the thread whose core is taken: measured here, one stream's decode fell from 26 to 6 tokens/s, where 1
thread ran at 15.6. tfq's bits do not depend on the thread count (checked on the running build before the
count is ever changed, and in tests/test_threads.py), so the count may follow the machine: between steps,
every few seconds, the engine reads how busy the other processes kept the cores (/proc/stat less this
process's own CPU time) and sets the threads to the cores left, at least 1 and at most the starting count.
Set OMP_NUM_THREADS to fix the count yourself.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch


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

    @classmethod
    def auto(cls) -> "Threads | None":
        """The policy, or None where the count must stay as it is (set by the user, or not provably safe)."""
        if os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() < 2 or read_sample() is None:
            return None
        return cls() if thread_count_invariant() else None

    def step(self) -> None:
        last = self.last
        if last is None or time.monotonic() - last.wall < self.every_s:
            return
        now = self.sample()
        if now is None or now.wall <= last.wall:
            return
        others = max(0.0, ((now.busy - last.busy) - (now.own - last.own)) / (now.wall - last.wall))
        want = max(1, min(self.most, int(self.cores - others + 0.5)))
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.fewest = min(self.fewest, want)
        self.last = now


def thread_count_invariant() -> bool:
    """Whether a long-row linear layer and the attention (chunk and decode) give the same bits on 1 thread as
    on all of them."""
    from kernels.attention import AttentionBatch, Chunk, DecodeGroup, attend
    from tfq.arithmetic import Linear

    g = torch.Generator().manual_seed(77)
    f = Linear(torch.randn(96, 4864, generator=g))
    x = torch.randn(8, 4864, generator=g)
    k, v = torch.randn(640, 2, 64, generator=g), torch.randn(640, 2, 64, generator=g)
    q = torch.randn(302, 6, 64, generator=g)
    decode = DecodeGroup(torch.tensor([300, 301]), torch.stack([torch.arange(320), torch.arange(320, 640)]),
                         torch.tensor([290, 17]))
    batch = AttentionBatch(decode, [Chunk(0, 300, 0, torch.arange(320))], False)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return f(x), attend(q, k, v, batch, 0.125)

    many = torch.get_num_threads()
    try:
        wide = run()
        torch.set_num_threads(1)
        return all(torch.equal(a, b) for a, b in zip(run(), wide))
    finally:
        torch.set_num_threads(many)
