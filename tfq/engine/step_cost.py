"""What a step costs on this machine, learned from the steps the engine ran: the clock of the step budget.

    seconds = a + b * rows + c * keys

rows: the rows the forward computes (a: what every step pays whatever it holds, such as reading every weight
once; b: a row's linear layers); keys: the cache rows its rows attend to, summed over them (attention). The
coefficients are fitted by least squares over the steps seen, each older step weighing DECAY times less, so the
fit follows the machine as its load and thread count change.
None of this touches a bit: it only decides how many prompt rows share a forward, and chunking is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

DECAY = 0.99  # a step's weight in the fit, one step later: about the last few hundred steps count
LEAST_STEPS = 8  # steps seen before the fit is trusted
RIDGE = 1e-9  # keeps the fit solvable while the steps seen do not yet vary in every term


@dataclass(frozen=True)
class Work:
    """What one forward computes, in the terms of the cost."""

    rows: int = 0
    keys: int = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.rows + other.rows, self.keys + other.keys)

    @staticmethod
    def total(works: Iterable["Work"]) -> "Work":
        return sum(works, Work())

    def terms(self) -> np.ndarray:
        return np.array([1.0, self.rows, self.keys])


def chunk_work(start: int, rows: int) -> Work:
    """`rows` rows at positions start, start + 1, ...: each attends to the cache up to and including itself."""
    return Work(rows, rows * start + rows * (rows + 1) // 2)


@dataclass
class StepCost:
    """The least-squares fit of a step's seconds to its Work, over the steps observed."""

    seen: int = 0
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _coef: np.ndarray | None = None

    def observe(self, work: Work, seconds: float) -> None:
        x = work.terms()
        self._gram = DECAY * self._gram + np.outer(x, x)
        self._moment = DECAY * self._moment + seconds * x
        self.seen += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        return self.seen >= LEAST_STEPS

    def seconds(self, work: Work) -> float:
        if self._coef is None:
            scale = np.maximum(np.diag(self._gram), 1e-12)  # the terms differ by orders of magnitude
            gram = self._gram / np.sqrt(np.outer(scale, scale)) + RIDGE * np.eye(3)
            coef = np.linalg.solve(gram, self._moment / np.sqrt(scale)) / np.sqrt(scale)
            self._coef = np.maximum(coef, 0.0)  # no term makes a step faster
        return float(self._coef @ work.terms())
