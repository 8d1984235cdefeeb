"""What the start-up guard proves of the sampler (tfq/engine/layer_guard.py): the tokens drawn from a probe's logits
rows and the log-probabilities the server returns, functions of one row each, so the same at every thread count."""
from __future__ import annotations

import torch

from tfq.decode.penalties import Penalties
from tfq.decode.sampling import logprob, sample

SAMPLE = dict(temperature=0.8, top_p=0.9, seed=7)  # besides greedy: a seeded top-p draw per logits row
# and a penalized draw, and one from a masked row (a grammar's mask as tfq/engine/core.py applies it: here every
# third token allowed), over a fixed history of tokens
PENALIZED = Penalties(presence=0.5, frequency=0.3, repetition=1.2, bias=((0, 2.0), (1, -100.0)))
HISTORY = (0, 1, 1, 2, 3, 5, 8, 13, 21, 34)


def drawn_tokens(rows: torch.Tensor, position: int) -> torch.Tensor:
    """The tokens the sampler draws from each logits row (a drawn token sitting at `position`): greedy, a seeded
    top-p draw, a penalized greedy draw and a seeded draw from a masked row."""
    return torch.tensor([[sample(row, 0.0, 1.0, 0, position), sample(row, position=position, **SAMPLE),
                          sample(PENALIZED.apply(row, HISTORY[:4], HISTORY[4:]), 0.0, 1.0, 0, position),
                          sample(_masked(row), position=position, **SAMPLE)] for row in rows])


def _masked(row: torch.Tensor) -> torch.Tensor:
    allowed = torch.arange(len(row)) % 3 == 0
    return torch.where(allowed, row, float("-inf"))


def scores(rows: torch.Tensor) -> torch.Tensor:
    """What the server returns as log-probabilities for each logits row: the greedy token's and the top 5 (ids
    and values)."""
    out = []
    for row in rows:
        s = logprob(row, int(row.argmax()), top=5)
        out.append([s.logprob, *(v for pair in s.top for v in pair)])
    return torch.tensor(out, dtype=torch.float64)
