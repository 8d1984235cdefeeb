"""The CPU thread count follows the cores other processes leave free, and never changes a stream's bits."""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engines import run
from served import eventually, server, tiny_served
from tfq.engine.core import EngineSettings
from tfq.engine.stream import Request
from tfq.engine.threads import CpuSample, Threads, fix_threads, ladder, read_sample, release_workers
from tfq.errors import TfqError


class FakeCpu:
    """Samples where other processes keep `others` cores busy and this one `own` cores."""

    def __init__(self):
        self.t = self.busy = self.own_s = 0.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own_s += seconds * own

    def __call__(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own_s)


def test_threads_follow_the_free_cores_down_and_back_up(monkeypatch):
    cpu = FakeCpu()
    monkeypatch.setattr("tfq.engine.threads.time.monotonic", lambda: cpu.t)
    before = torch.get_num_threads()
    asked: list[int] = []

    def proved(n: int) -> bool:
        asked.append(n)
        return n != 4  # a count the guard refused on this (imagined) build

    try:
        torch.set_num_threads(6)
        policy = Threads(most=6, every_s=2.0, sample=cpu, cores=6)
        cpu.advance(1.0, others=1.0, own=2.0)
        policy.step(proved)  # too soon: nothing sampled, nothing changed
        assert torch.get_num_threads() == 6
        cpu.advance(2.0, others=1.0, own=5.0)  # another process keeps a core busy: 5 free, 4 refused, so 2
        policy.step(proved)
        assert torch.get_num_threads() == 2 and policy.fewest == 2 and asked == [4, 2]
        cpu.advance(3.0, others=0.1, own=2.0)  # it is gone: back up to the starting count
        policy.step(proved)
        assert torch.get_num_threads() == 6
        cpu.advance(3.0, others=9.0, own=1.0)  # never below 1
        policy.step(proved)
        assert torch.get_num_threads() == 1 and asked == [4, 2, 6, 1]  # 4 is not asked twice
        torch.set_num_threads(3)
        policy.restore()  # the next engine starts from the starting count, not from a busy spell's
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


def test_the_policy_moves_on_a_ladder_of_proved_counts():
    assert ladder(1) == [1]
    assert ladder(2) == [2, 1]
    assert ladder(6) == [6, 4, 2, 1]
    assert ladder(64) == [64, 32, 16, 8, 4, 2, 1]


def test_threads_fixed_by_the_user_turn_the_policy_off(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("TFQ_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        fix_threads(7)  # more than this machine's cores: exactly 7 all the same
        assert torch.get_num_threads() == 7 and Threads.auto() is None
        monkeypatch.setenv("TFQ_THREADS", "3")
        fix_threads(None)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("TFQ_THREADS", "three")
        with pytest.raises(TfqError, match="TFQ_THREADS"):
            fix_threads(None)
        with pytest.raises(TfqError, match="at least 1"):
            fix_threads(0)
    finally:
        torch.set_num_threads(before)


def test_this_machine_can_be_sampled():
    s = read_sample()
    assert s is not None and s.busy > 0 and s.own > 0


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _named(name: str) -> set[int]:
    """This process's threads called `name`, but the calling one."""
    found = set()
    for tid in _tids() - {threading.get_native_id()}:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.add(tid)
        except OSError:  # it ended while we looked
            pass
    return found


def _on_a_new_thread(work, name: str = "tfq-omp-check"):
    """work(name) on a thread of its own called `name` (no OpenMP workers yet, whatever earlier tests ran): a
    thread it starts, such as an OpenMP worker, takes the name too, so its workers are told from any other."""

    def named():
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        torch.set_num_threads(2)
        return work(name)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(named).result()


def _linear():
    from tfq.kernels import cpu_build

    g = torch.Generator().manual_seed(7)
    panels, x = cpu_build.op("pack")(torch.randn(256, 64, generator=g)), torch.randn(3, 64, generator=g)
    return cpu_build.op("linear")(x, panels, None, 256)  # 4 panels on 2 threads: a parallel region


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads this process's threads in /proc (Linux)")
def test_a_thread_gives_its_openmp_workers_back_and_gets_them_again(restored_threads):
    """A thread gives back its OpenMP workers (tfq/engine/threads.py: release_workers, what a served engine's builder
    does), and computing again brings workers back, with the same bits. Control: a thread that only computes
    keeps its workers (libgomp keeps them for the thread's whole life)."""

    def work(name):
        first = _linear()
        workers = _named(name)
        assert workers, "a parallel region at 2 threads started no worker"
        assert torch.equal(_linear(), first) and _named(name) == workers  # control: a thread keeps its workers
        assert release_workers()
        assert eventually(lambda: not workers & _tids(), timeout_s=30), "the workers did not go"
        assert torch.equal(_linear(), first) and _named(name) - workers, "no workers came back"

    _on_a_new_thread(work)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads this process's threads in /proc (Linux)")
def test_the_thread_that_builds_a_server_keeps_no_workers(tiny_dirs, tiny_models, restored_threads):
    """`tfq serve` builds its engine on one thread and steps it on another (tfq/serve/loop.py): the builder's
    workers go, so the engine thread's are the only ones. (Without the release they stay: the control above.)"""

    def work(name):
        _linear()
        workers = _named(name)
        assert workers, "a parallel region at 2 threads started no worker"
        served = server(tiny_served(tiny_dirs, tiny_models))
        assert eventually(lambda: not workers & _tids(), timeout_s=30), "the builder kept its workers"
        assert not served.loop.dead

    _on_a_new_thread(work)


COUNTS = (1, 2, 3, 4, 5, 8, 16)


class Flip:
    """A policy that changes the thread count before every forward, through 1 to 16 threads."""

    def __init__(self):
        self.steps = 0

    def step(self, proved) -> None:
        self.steps += 1
        torch.set_num_threads(COUNTS[self.steps % len(COUNTS)])

    def restore(self) -> None:
        pass


def test_changing_threads_between_steps_keeps_every_bit(tiny_models):
    model = tiny_models["qwen2"].model
    g = torch.Generator().manual_seed(4)
    requests = [Request(tuple(torch.randint(3, 500, (n,), generator=g).tolist()), max_tokens=8) for n in (9, 140, 40)]
    settings = EngineSettings(window=256, lanes=3, prefill_chunk=32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = run(model, requests, settings, keep_logits=True)
        flip = Flip()
        flipped = run(model, requests, settings, keep_logits=True, threads=flip)
    finally:
        torch.set_num_threads(before)
    assert flip.steps > 5
    for a, b in zip(fixed, flipped):
        assert a.ids == b.ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
