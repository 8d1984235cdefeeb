"""Choosing the next token from one stream's fp32 logits: a function of the row, the settings and the position.

Greedy is argmax (the lowest id wins a tie). With temperature > 0 each draw uses its own generator keyed by
(seed, position): no global RNG, so a stream draws the same token alone, batched, drafted or recomputed.
Log-probabilities are the log-softmax of the same row, in float64 on one thread (numpy), so they too are a
function of the row's bits alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


def digest(logits: torch.Tensor) -> str:
    """A short hash of a logits row's exact bits."""
    return hashlib.sha256(logits.contiguous().numpy()).hexdigest()[:16]  # hashed in place, not copied


def draw_key(seed: int, position: int) -> int:
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int) -> int:
    """logits: [vocab] fp32. position: where the drawn token will sit in the stream."""
    if temperature <= 0:  # numpy's argmax (the first of equal maxima) is 25x faster here than torch's
        return int(logits.numpy().argmax())
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled).all()):  # T so small that logits / T overflows: scale from the max,
        scaled = (logits - logits.max()) / temperature  # which stays 0 (the rest -inf), not inf - inf = NaN
    probs = torch.softmax(scaled, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    cum = torch.cumsum(sorted_probs, 0)
    if top_p < 1.0:
        keep = int(torch.searchsorted(cum, torch.tensor([top_p]))) + 1  # smallest head holding top_p
        sorted_probs, cum = sorted_probs[:keep], cum[:keep]
    g = torch.Generator().manual_seed(draw_key(seed, position))
    u = torch.rand(1, generator=g, dtype=torch.float64).item() * float(cum[-1])
    i = min(int(torch.searchsorted(cum.double(), torch.tensor([u], dtype=torch.float64), right=True)), len(cum) - 1)
    return int(order[i])


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under one logits row, and the row's `top` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first; ties: lower id


def log_softmax(logits: torch.Tensor) -> np.ndarray:
    """The row's log-softmax in float64. numpy sums on one thread in a fixed (pairwise) order, so the bits do
    not depend on torch's thread count or on anything beside the row."""
    x = logits.numpy().astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


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
