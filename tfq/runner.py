"""The runner: a Step's feeds through the model in one forward, in the arithmetic an attention policy picks.

The policy is the plan's arithmetic (`rows`, or `partial` when the plan says so) for every forward; the
together check hands the engine another one, `paged_partial`, to reproduce the field report's fault on
purpose: the batch's shape picks the arithmetic there, which is exactly what tfq never does otherwise.
"""
from __future__ import annotations

from typing import Callable

import torch

from tfq.batch import Feed, forward
from tfq.cache import KVCache

AttentionPolicy = Callable[[list[Feed]], bool]  # a forward's feeds -> whether it runs the `partial` arithmetic


def plan_arithmetic(partial: bool) -> AttentionPolicy:
    """The plan's arithmetic, the same for every forward whatever it holds."""
    return lambda feeds: partial


def paged_partial(feeds: list[Feed]) -> bool:
    """The control: forwards that hold a paged stream run `partial`, the others `rows` (the field report)."""
    return any(f.placement.paged for f in feeds)


class ColdPartial:
    """The prefix cache's control: `partial` until `warm()`, `rows` after, under one cache, so pages computed
    in one arithmetic are found again by streams of the other (tfq never does this: the cache's key names the
    plan's arithmetic). One object per engine: it has a state."""

    def __init__(self) -> None:
        self.partial = True

    def warm(self) -> None:
        self.partial = False

    def __call__(self, feeds: list[Feed]) -> bool:
        return self.partial


class Runner:
    def __init__(self, model, cache: KVCache, policy: AttentionPolicy, chunked_deltanet: bool = False):
        self.model, self.cache, self.policy = model, cache, policy
        self.chunked = chunked_deltanet  # a hybrid's control: prompt chunks in the chunked DeltaNet arithmetic
        self.forwards = 0

    def run(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """Each feed's logits rows [logits, vocab] (fp32, on the CPU)."""
        self.forwards += 1
        return forward(self.model, self.cache, feeds, self.policy(feeds), self.chunked)
