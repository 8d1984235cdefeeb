"""Lanes sized to the streams a command knows it runs.

The default plan holds 8 lanes because a server does not know its streams; each lane is a window of cache rows
(96 MiB on the default model), and the largest forward's activations grow with it. A command that knows its
streams (one prompt, `-p` given twice, a file of prompts, a suite) needs no more lanes than that: its plan
takes min(streams, the plan's lanes), unless the plan file, TFQ_LANES or --set named lanes. The window stays the
plan's. Lanes change no bits (a stream's tokens and logits are the same at any batch), only the memory held.
"""
from __future__ import annotations

from dataclasses import dataclass

from tfq.plan.schema import Plan
from tfq.plan.words import SIZED


@dataclass(frozen=True)
class Streams:
    """The streams a command runs at once at most, and how the plan line names them ("2 prompts")."""

    count: int
    words: str

    @classmethod
    def of(cls, count: int, noun: str) -> "Streams":
        return cls(count, f"{count} {noun}{'s' * (count != 1)}")


def named(plan: Plan, key: str) -> bool:
    """Whether someone chose `key`: the plan file wrote it, or a TFQ_* variable, --set or --model set it."""
    return key in plan.named or plan.source(key) is not None


def size_lanes(plan: Plan, streams: Streams | None) -> Plan:
    """`plan` with lanes cut to the streams known, its source saying so; as it was when the streams are not known
    (a server), when they fill its lanes, or when lanes was named (the user's choice wins)."""
    if streams is None or streams.count < 1 or streams.count >= plan.lanes or named(plan, "lanes"):
        return plan
    return plan.set("lanes", streams.count, f"{SIZED}{streams.words}; --set lanes=N to change")
