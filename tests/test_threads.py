"""The CPU thread count follows the cores other processes leave free, and never changes a stream's bits."""
from __future__ import annotations

import torch

from tfq.engine import Engine, EngineSettings
from tfq.stream import Request
from tfq.threads import CpuSample, Threads, read_sample, thread_count_invariant


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


def test_threads_follow_the_free_cores(monkeypatch):
    cpu = FakeCpu()
    monkeypatch.setattr("tfq.threads.time.monotonic", lambda: cpu.t)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        policy = Threads(most=2, every_s=2.0, sample=cpu, cores=2)
        cpu.advance(1.0, others=1.0, own=2.0)
        policy.step()  # too soon: nothing sampled, nothing changed
        assert torch.get_num_threads() == 2
        cpu.advance(2.0, others=1.0, own=1.6)  # another process keeps a core busy
        policy.step()
        assert torch.get_num_threads() == 1 and policy.fewest == 1
        cpu.advance(3.0, others=0.1, own=1.0)  # it is gone
        policy.step()
        assert torch.get_num_threads() == 2
        cpu.advance(3.0, others=4.0, own=1.0)  # never below 1
        policy.step()
        assert torch.get_num_threads() == 1
        policy.most = 1
        cpu.advance(3.0, others=0.0, own=1.0)  # never above the starting count
        policy.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_this_machine_can_be_sampled_and_the_build_is_thread_invariant():
    s = read_sample()
    assert s is not None and s.busy > 0 and s.own > 0
    assert thread_count_invariant()


class Flip:
    """A policy that changes the thread count before every forward."""

    def __init__(self):
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        torch.set_num_threads(1 + self.steps % 2)


def test_changing_threads_between_steps_keeps_every_bit(tiny_models):
    model = tiny_models["qwen2"].model
    g = torch.Generator().manual_seed(4)
    requests = [Request(tuple(torch.randint(3, 500, (n,), generator=g).tolist()), max_tokens=8) for n in (9, 140, 40)]
    settings = EngineSettings(window=256, lanes=3, prefill_chunk=32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = Engine(model, settings, keep_logits=True).generate(requests)
        flip = Flip()
        flipped = Engine(model, settings, keep_logits=True, threads=flip).generate(requests)
    finally:
        torch.set_num_threads(before)
    assert flip.steps > 5
    for a, b in zip(fixed, flipped):
        assert a.ids == b.ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
