"""What a step costs on this machine, learned from the steps the engine ran: the clock of the step budget.

    seconds = a + b * rows + c * keys

rows: the rows the forward computes (a: what every step pays whatever it holds, such as reading every weight
once; b: a row's linear layers); keys: the cache rows its rows attend to, summed over them (attention). The
coefficients are fitted by least squares over the steps seen, each older step weighing DECAY times less, so the
fit follows the machine as its load and thread count change.
None of this touches a bit: it only decides how many prompt rows share a forward, and chunking is exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

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

    def terms(self) -> tuple[float, float, float]:
        return (1.0, float(self.rows), float(self.keys))


def chunk_work(start: int, rows: int) -> Work:
    """`rows` rows at positions start, start + 1, ...: each attends to the cache up to and including itself."""
    return Work(rows, rows * start + rows * (rows + 1) // 2)


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a 3 x 3 system that is symmetric positive definite (Gaussian elimination, no pivoting:
    its diagonal stays positive). Plain floats: numpy's per-call cost was a tenth of a millisecond a step."""
    a = [row[:] for row in a]
    b = b[:]
    for i in range(3):
        for j in range(i + 1, 3):
            f = a[j][i] / a[i][i]
            for k in range(i, 3):
                a[j][k] -= f * a[i][k]
            b[j] -= f * b[i]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (b[i] - sum(a[i][k] * x[k] for k in range(i + 1, 3))) / a[i][i]
    return x


@dataclass
class StepCost:
    """The least-squares fit of a step's seconds to its Work, over the steps observed (3 x 3 normal equations, in
    plain floats: a decode step at one lane asks for it a few times)."""

    seen: int = 0
    _gram: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _moment: list[float] = field(default_factory=lambda: [0.0] * 3)
    _coef: list[float] | None = None

    def observe(self, work: Work, seconds: float) -> None:
        x = work.terms()
        self._gram = [[DECAY * g + xi * xj for g, xj in zip(row, x)] for row, xi in zip(self._gram, x)]
        self._moment = [DECAY * m + seconds * xi for m, xi in zip(self._moment, x)]
        self.seen += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        return self.seen >= LEAST_STEPS

    def seconds(self, work: Work) -> float:
        coef = self._coef  # read once: a server's watchdog asks from its own thread while a step observes
        if coef is None:
            # the terms differ by orders of magnitude: solved on the scaled system
            g, moment = self._gram, self._moment
            root = [math.sqrt(max(g[i][i], 1e-12)) for i in range(3)]
            gram = [[g[i][j] / (root[i] * root[j]) + (RIDGE if i == j else 0.0) for j in range(3)] for i in range(3)]
            solved = _solve3(gram, [m / r for m, r in zip(moment, root)])
            self._coef = coef = [max(c / r, 0.0) for c, r in zip(solved, root)]  # no term makes a step faster
        return sum(c * t for c, t in zip(coef, work.terms()))
