"""Penalties without a model: Penalties.apply is its definition written out in float32, in vLLM's order. The
constrained and penalized replies through the engine are in tests/test_structured.py."""
from __future__ import annotations

import numpy as np
import torch

from tfq.decode.penalties import Penalties

# tests/test_structured.py's penalized requests take these too
PENALIZED = Penalties(presence=0.6, frequency=0.4, repetition=1.3, bias=((17, 4.0), (40, -100.0)))


def test_penalties_follow_their_definition():
    """Penalties.apply against the definition written out token by token in float32 (vLLM's order: bias, then
    repetition over prompt and reply, then frequency and presence over the reply). The control counts the
    prompt's tokens in the frequency too, as some engines do: other bits."""
    g = torch.Generator().manual_seed(4)
    row = torch.randn(300, generator=g) * 4
    prompt, reply = [3, 5, 5, 17, 250], [5, 9, 9, 9, 40, 17]
    p = PENALIZED

    def by_definition(counted: list[int]) -> np.ndarray:
        x = row.numpy().copy()
        for t, b in p.bias:
            x[t] = np.float32(x[t] + np.float32(b))
        r = np.float32(p.repetition)
        for t in set(prompt) | set(reply):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        for t in set(counted):
            x[t] = np.float32(x[t] - np.float32(np.float32(p.frequency) * np.float32(counted.count(t))))
            x[t] = np.float32(x[t] - np.float32(p.presence))
        return x

    got = p.apply(row, prompt, reply).numpy()
    assert np.array_equal(got.view(np.int32), by_definition(reply).view(np.int32))
    assert not np.array_equal(got.view(np.int32), by_definition(prompt + reply).view(np.int32))  # control
    assert not Penalties() and bool(Penalties(repetition=1.1))
