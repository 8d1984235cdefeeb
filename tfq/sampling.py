"""Choosing the next token from one stream's fp32 logits: a function of the row, the settings and the position.

Greedy is argmax (the lowest id wins a tie). With temperature > 0 each draw uses its own generator keyed by
(seed, position): no global RNG, so a stream draws the same token alone, batched, drafted or recomputed.
Probabilities and log-probabilities come from one recipe whose every step has one answer on every CPU: each
token's exp(logit - max) rounded to the nearest float32 (tfq/nearest.py: not torch's or numpy's vector exp,
whose last bit follows the instruction set), summed in float64 in a fixed order, the log of the sum correctly
rounded. So they are a function of the row's bits alone, on any machine and at any thread count.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from tfq.nearest import exp32, log64


def digest(logits: torch.Tensor) -> str:
    """A short hash of a logits row's exact bits."""
    return hashlib.sha256(logits.contiguous().numpy()).hexdigest()[:16]  # hashed in place, not copied


def draw_key(seed: int, position: int) -> int:
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def weights(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(logits - max in float64, exp of that rounded to float32): each token's weight, the largest exactly 1."""
    x = logits.numpy().astype(np.float64)
    d = x - x.max()
    return d, exp32(d)


def sample(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int) -> int:
    """logits: [vocab] fp32. position: where the drawn token will sit in the stream."""
    if temperature <= 0:  # numpy's argmax (the first of equal maxima) is 25x faster here than torch's
        return int(logits.numpy().argmax())
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled).all()):  # T so small that logits / T overflows: scale from the max,
        scaled = (logits - logits.max()) / temperature  # which stays 0 (the rest -inf), not inf - inf = NaN
    w = torch.from_numpy(weights(scaled)[1])
    order = torch.argsort(w, descending=True, stable=True)  # one order: by weight, then by id
    cum = np.cumsum(w[order].numpy(), dtype=np.float64)  # one sum after another, in that order
    keep = len(cum)
    if top_p < 1.0:  # the smallest head holding top_p of the whole
        keep = int(np.searchsorted(cum, top_p * cum[-1])) + 1
    g = torch.Generator().manual_seed(draw_key(seed, position))
    u = torch.rand(1, generator=g, dtype=torch.float64).item() * float(cum[keep - 1])
    return int(order[min(int(np.searchsorted(cum[:keep], u, side="right")), keep - 1)])


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under one logits row, and the row's `top` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first; ties: lower id


def log_softmax(logits: torch.Tensor) -> np.ndarray:
    """The row's log-softmax in float64: logit - max - log(sum of the weights), by the recipe of `weights`."""
    d, w = weights(logits)
    return d - log64(w.sum(dtype=np.float64))


def logprob(logits: torch.Tensor, token: int, top: int = 0) -> TokenLogprob:
    """`token`'s log-probability under `logits` [vocab] fp32, with the `top` most likely tokens."""
    lp = log_softmax(logits)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        cut = np.partition(lp, len(lp) - top)[len(lp) - top]  # the top-th largest value
        ids = np.flatnonzero(lp >= cut)  # ascending ids; a stable sort keeps the lower id first on a tie
        ids = ids[np.argsort(-lp[ids], kind="stable")][:top]
        best = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(int(token), float(lp[token]), best)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request with `n` choices: the request's own seed for choice 0 (so n = 1
    and the first of n agree), a hash of (seed, choice) for the others."""
    if choice == 0:
        return seed
    h = hashlib.blake2b(f"{seed}/choice/{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)
