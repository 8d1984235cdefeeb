"""What a draw reads of a logits row (every value finite, the first largest), taken by the model's one object where
its head writes the row (kernels/cpu/row_facts.h): numpy's answers on every row, ties, signed zeros, infinities and
NaNs anywhere included; the engine's checks and greedy draws take them with the same replies; and the start-up
guard refuses an object whose answers differ from numpy's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from test_one_call import SETTINGS, replies
from tfq.engine.layer_guard import STACKED_FACTS, LayerProof, _facts_by_numpy
from tfq.engine.runner import Runner
from tfq.kernels import cpu_build

pytestmark = pytest.mark.skipif(not cpu_build.built(), reason="tfq's CPU kernels are not built here")


def hostile_rows() -> list[torch.Tensor]:
    """Rows of lengths around the kernel's vectors (16) and blocks (1024), a vocabulary's too, with the largest
    tied across a block's edge and within a vector's tail, as +0 and -0, and with an infinity or a NaN in the
    vectors, in the tail, or everywhere."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for n in (1, 15, 16, 17, 1023, 1024, 1025, 3000, 151936):
        x = torch.randn(n, generator=g)
        rows.append(x)
        for spots in ([n - 1], [0, n - 1], [n // 2, n - 1], [1023, 1024], [5, 2000, 2001]):
            tied = x.clone()
            for i in (i for i in spots if i < n):
                tied[i] = 9.0
            rows.append(tied)
        zeros = -torch.rand(n, generator=g) - 1
        zeros[n // 3], zeros[n - 1] = -0.0, 0.0
        rows.append(zeros)
        for bad in (float("inf"), float("-inf"), float("nan")):
            for at in {0, n // 2, n - 1}:
                y = x.clone()
                y[at] = bad
                rows.append(y)
        rows.append(torch.full((n,), float("-inf")))
    return rows


def test_the_facts_of_a_row_are_numpys():
    """Every hostile row's (finite, first largest) from the kernel equals numpy's finite check and argmax. Control:
    the last of equal maxima (what a reduction that keeps the later of two ties gives) differs on the tied rows."""
    facts = cpu_build.op("row_facts")
    rows = hostile_rows()
    for row in rows:
        assert torch.equal(facts(row[None].contiguous()), _facts_by_numpy(row[None])), row

    def last_of_ties(row: torch.Tensor) -> torch.Tensor:
        flipped = _facts_by_numpy(row.flip(0)[None])
        return torch.tensor([[1, row.numel() - 1 - int(flipped[0, 1])]]) if flipped[0, 0] else flipped

    assert any(not torch.equal(last_of_ties(row), _facts_by_numpy(row[None])) for row in rows)


@pytest.mark.parametrize("name", ["fp32, whole", "bf16, paged, chunked"])
def test_greedy_draws_take_the_objects_facts_with_the_same_replies(tiny_models, monkeypatch, name):
    """A dense model's greedy replies through its one object take each decode row's check and token from the
    facts its head gave (most rows), with the ids and logits digests of replies that read every row in numpy."""
    model = tiny_models["qwen3"].model
    taken, drawn = [], Runner.drawn
    monkeypatch.setattr(Runner, "drawn", lambda self, i: taken.append(drawn(self, i)) or taken[-1])
    with_facts = replies(model, SETTINGS[name])
    assert sum(f is not None for f in taken) > len(taken) // 2
    monkeypatch.setattr(Runner, "drawn", lambda self, i: None)
    assert replies(model, SETTINGS[name]) == with_facts


def test_control_the_guard_refuses_an_object_whose_facts_are_not_numpys(tiny_models, monkeypatch):
    """An object that names the next token as each row's largest (its logits unharmed) is refused, named: the guard
    holds what the object says of its rows against numpy's answers."""
    model = tiny_models["qwen3"].model
    one = model.backend.stack_forward

    def off(*a):
        out = one(*a)
        if len(a) > 6 and a[6] is not None:
            a[6].table[:, 1] += 1
        return out

    backend = dataclasses.replace(model.backend, stack_forward=off)
    monkeypatch.setattr(model, "backend", backend)
    monkeypatch.setattr(model, "stack", model.stack._replace(backend=backend))
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    assert failure is not None and failure.op.endswith(STACKED_FACTS), failure
    monkeypatch.undo()
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None
