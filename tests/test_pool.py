"""The tensors tfq's CPU kernels hand back come from a pool of reused ones (kernels/cpu/pool.h): the one object's
decode forward reuses its tensors, with the bits of the layers op by op, and no tensor anyone still holds (an
output, a view of it) is ever handed out again."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from test_one_call import SETTINGS, replies
from tfq.engine.core import Engine, EngineSettings
from tfq.engine.stream import Request
from tfq.kernels import cpu_build

pytestmark = pytest.mark.skipif(not cpu_build.built(), reason="tfq's CPU kernels are not built here")


def counts() -> tuple[int, int]:
    """(tensors handed out again, tensors made and kept) by this thread's pool"""
    again, made = cpu_build.op("pool_counts")()
    return again, made


def test_the_one_object_reuses_its_tensors_with_the_bits_of_the_ops(tiny_models, monkeypatch):
    """A dense model's replies through its one object, paged and chunked too, reuse hundreds of tensors (each
    decode step's norms, residuals and outputs, every layer), and their ids and logits digests are those of the
    layers op by op."""
    model = tiny_models["qwen3"].model
    assert model.runs_as_stack()
    for name in ("fp32, whole", "bf16, paged, chunked"):
        again = counts()[0]
        stacked = replies(model, SETTINGS[name])
        assert counts()[0] - again > 8 * len(model.layers)  # 3 streams of 8 tokens: well over a few a layer a step
        with monkeypatch.context() as m:
            m.setattr(model, "stack", None)
            m.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
            assert replies(model, SETTINGS[name]) == stacked


def made_a_step(model, before_each: Callable[[], None], steps: int = 6) -> float:
    """Tensors this thread's pool made (not handed out again) a decode step of one stream through the model's one
    object, its slots first filled with tensors of other sizes held by Python (as a server's earlier requests leave
    them)."""
    engine = Engine(model, EngineSettings(window=64, lanes=1), eos_ids=())
    engine.add(Request(tuple(range(3, 15)), max_tokens=steps + 4))
    engine.step()  # the prompt, and the first draw
    ops, g = cpu_build.ops(), torch.Generator().manual_seed(1)
    with torch.inference_mode():
        held = [ops.silu(torch.randn(1, 8 + n, generator=g)) for n in range(40)]
    for _ in range(2):  # two steps to find the sizes a step takes again
        before_each()
        engine.step()
    made = counts()[1]
    for _ in range(steps):
        before_each()
        engine.step()
    assert len(held) == 40
    return (counts()[1] - made) / steps


def test_a_decode_step_makes_no_tensor_but_its_logits(tiny_models):
    """A decode step of one stream holds several tensors of one size at once (a layer's residual, its norm, the
    attention's output, the next sums); each is handed out again step after step, even with every slot of the pool
    taken by tensors of other sizes: the step makes one tensor, the logits row that goes to Python. Control: the pool
    forgotten before each step (pool_release) makes every tensor of the step, and the count says so."""
    model = tiny_models["qwen3"].model
    assert model.runs_as_stack()
    assert made_a_step(model, lambda: None) <= 1
    assert made_a_step(model, cpu_build.op("pool_release")) > 4 * len(model.layers)


def held_outputs_intact(make: Callable[[int], torch.Tensor], calls: int = 100) -> bool:
    """make(i) called `calls` times, every other output held and a view of every third: every output held (and the
    memory under every view) keeps the bits it had when made, and no two live outputs share memory."""
    held, views = [], []
    for i in range(calls):
        out = make(i)
        if i % 2 == 0:
            held.append((out, out.clone()))
        if i % 3 == 0:
            views.append((out[:, 1:], out[:, 1:].clone()))
    starts = [t.data_ptr() for t, _ in held]
    return all(torch.equal(t, was) for t, was in held + views) and len(set(starts)) == len(starts)


@pytest.mark.parametrize("mode", ["inference", "plain"])
def test_a_tensor_held_is_never_handed_out_again(mode):
    """tfq's norm, SiLU and linear ops called again and again (more calls than the pool keeps tensors), in and out
    of inference mode, their outputs and views of them held: every held output keeps its bits. Control: a maker
    that hands out one tensor again and again, as a pool blind to its holders would, fails the same check."""
    ops = cpu_build.ops()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, generator=g)
    panels = ops.pack(torch.randn(64, 96, generator=g))

    def make(i: int) -> torch.Tensor:
        x = torch.randn(2, 96, generator=g)
        return (ops.rms_norm(x, w, 1e-6), ops.silu(x), ops.linear(x, panels, None, 64))[i % 3]

    with torch.inference_mode(mode == "inference"):
        assert held_outputs_intact(make)
        blind = torch.empty(2, 96)
        assert not held_outputs_intact(lambda i: blind.copy_(torch.randn(2, 96, generator=g)))
