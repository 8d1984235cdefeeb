"""A forward's rows as a hybrid's DeltaNet layers take them: each feed's first row, rows, state slot, whether it
starts fresh and whether it saves its state for a roll-back. The runner builds them (tfq/engine/batch.py); the
model reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np
import torch


class Segment(NamedTuple):
    """One feed's rows in a forward, as a DeltaNet layer takes them."""

    first: int  # its first row in the forward
    rows: int
    slot: int  # the state slot it reads and updates (its lane)
    fresh: bool  # it starts at position 0: the state starts from zeros
    save: bool  # a verify: the slot's state is saved first, to roll rejected guesses back


@dataclass(frozen=True)
class Segments:
    """Every feed's Segment, as the [feeds, 5] int64 table the kernels read (columns in Segment's order), and the
    arithmetic the forward's layers run by beyond attention (the DeltaNet algorithm, the experts' combine)."""

    table: torch.Tensor
    chunked: bool = False  # Arithmetic.chunked_deltanet
    experts_by_load: bool = False  # Arithmetic.experts_by_load

    @classmethod
    def of(cls, segments: list[Segment], chunked: bool = False, experts_by_load: bool = False) -> "Segments":
        table = np.array(segments, dtype=np.int64).reshape(-1, 5)  # numpy: torch.tensor of a list is slower
        return cls(torch.from_numpy(table), chunked, experts_by_load)

    def __iter__(self) -> Iterator[Segment]:
        return (Segment(r, n, slot, bool(fresh), bool(save)) for r, n, slot, fresh, save in self.table.tolist())
