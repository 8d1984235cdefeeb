"""The runner: everything a step computes. A Step's feeds through the model in one forward, in the arithmetic an
attention policy picks; the drafter's guesses for the next step (its own forwards); a hybrid's state rolled back
after a verify that kept fewer rows than it fed (tfq.engine.scheduler.Verified).

The policy is the plan's arithmetic (`rows` attention, or `partial` when the plan says so) for every forward;
the checks hand the engine others as data, to show on purpose what tfq never does: `paged_partial` (the field
report's fault: the batch's shape picks the attention), `ColdPartial` (a prefix cached in another arithmetic),
`chunked_deltanet` (a hybrid's prompt chunks by another DeltaNet algorithm than its decode rows).
"""
from __future__ import annotations

from typing import Callable

import torch

from tfq.engine.batch import Arithmetic, DecodeRows, Feed, forward
from tfq.engine.cache import KVCache
from tfq.engine.scheduler import Verified
from tfq.engine.stream import Stream

Policy = Callable[[list[Feed]], Arithmetic]  # a forward's feeds -> the arithmetic it runs


def plan_arithmetic(partial: bool) -> Policy:
    """The plan's arithmetic, the same for every forward whatever it holds."""
    arithmetic = Arithmetic(partial)
    return lambda feeds: arithmetic


def paged_partial(feeds: list[Feed]) -> Arithmetic:
    """The control: forwards that hold a paged stream run `partial`, the others `rows` (the field report)."""
    return Arithmetic(partial=any(f.placement.paged for f in feeds))


def chunked_deltanet(partial: bool) -> Policy:
    """The hybrid's control: the plan's attention, and prompt chunks by the chunked DeltaNet algorithm
    (transformers' way) while decode rows run the recurrence."""
    arithmetic = Arithmetic(partial, chunked_deltanet=True)
    return lambda feeds: arithmetic


def experts_by_load(partial: bool) -> Policy:
    """The mixture-of-experts control: the plan's attention, and each forward's experts combined in the order of
    how many of its rows chose them, as a fused MoE kernel sums (tfq/model/moe.py: combine_by_load)."""
    arithmetic = Arithmetic(partial, experts_by_load=True)
    return lambda feeds: arithmetic


class ColdPartial:
    """The prefix cache's control: `partial` until `warm()`, `rows` after, under one cache, so pages computed
    in one arithmetic are found again by streams of the other (tfq never does this: the cache's key names the
    plan's arithmetic). One object per engine: it has a state."""

    def __init__(self) -> None:
        self.partial = True

    def warm(self) -> None:
        self.partial = False

    def __call__(self, feeds: list[Feed]) -> Arithmetic:
        return Arithmetic(self.partial)


class Runner:
    def __init__(self, model, cache: KVCache, policy: Policy, drafter=None):
        self.model, self.cache, self.policy = model, cache, policy
        self.drafter = drafter  # tfq.engine.draft.Drafter or None
        self.forwards = 0
        self.decode_rows = DecodeRows(cache)

    def run(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """Each feed's logits rows [logits, vocab] (fp32, on the CPU)."""
        self.forwards += 1
        return forward(self.model, self.cache, feeds, self.policy(feeds), self.decode_rows)

    def drawn(self, i: int) -> tuple[bool, int] | None:
        """What the last forward's one object said of feed i's logits row (DecodeRows.drawn), or None."""
        return self.decode_rows.drawn(i)

    def propose(self, streams: list[Stream], budgets: list[int]) -> dict[int, list[int]]:
        """The drafter's guesses for the next step: stream id -> up to budgets[i] tokens."""
        if self.drafter is None or not streams:
            return {}
        return {st.id: list(g) for st, g in zip(streams, self.drafter.propose(streams, budgets)) if g}

    def settle(self, verified: list[Verified]) -> None:
        """A hybrid's DeltaNet state after only the rows of each verify that stand (the keys and values need
        nothing: the rows past them are never read, and the scheduler gave their pages back)."""
        if self.cache.state is None:
            return
        for v in verified:
            self.model.roll_back(self.cache, v.slot, v.kept)
