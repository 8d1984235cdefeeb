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
import math
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tfq.errors import TfqError
from tfq.nearest import BLOCK, exp32, log64


def digest(logits: torch.Tensor) -> str:
    """A short hash of a logits row's exact bits: XXH3's 64 bits, in hex. Each digest is compared with one computed
    again from logits (a replay, a record, another arm), never trusted as a commitment on its own, so the hash
    needs no cryptographic strength; sha256 of a 152k-float row took 0.4-0.5 ms of a 25 ms step, XXH3 takes 15 us."""
    return xxhash.xxh3_64_hexdigest(logits.contiguous().numpy())  # hashed in place, whatever its shape (empty too)


def finite(logits: torch.Tensor) -> bool:
    """Whether every value of a logits row is finite, from its largest and least (numpy's max and min carry a NaN
    anywhere into their answer, an infinity shows as one or the other): two vector passes on this thread, several
    times cheaper than a sum or a test of each value (torch's may start a parallel region, costly on a busy machine)."""
    x = logits.numpy()
    return math.isfinite(float(x.max())) and math.isfinite(float(x.min()))


def draw_key(seed: int, position: int) -> int:
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def weights(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(logits - max in float64, exp of that rounded to float32): each token's weight, the largest exactly 1."""
    x = logits.numpy()
    d = np.subtract(x, np.float64(x.max()), dtype=np.float64)  # exact: two float32s' difference fits a float64
    return d, exp32(d)


def sample(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int) -> int:
    """logits: [vocab] fp32. position: where the drawn token will sit in the stream.

    The recipe: tokens in one order (by weight, then by id), their weights summed one after another in float64
    in that order; top-p keeps the smallest head holding top_p of the whole; a keyed uniform draw picks within
    it. Only the head is ever sorted: the whole's sum needs the weights' values in order, not their ids."""
    if temperature <= 0:  # numpy's argmax (the first of equal maxima) is 25x faster here than torch's
        x = logits.numpy()
        token = int(x.argmax())  # a NaN anywhere is "the largest": it shows in the check
        drawable(float(x[token]), position)
        return token
    top = logits.max()  # a NaN anywhere makes it NaN
    drawable(float(top), position)
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled).all()):  # T so small that logits / T overflows: scale from the max,
        scaled = (logits - top) / temperature  # which stays 0 (the rest -inf), not inf - inf = NaN
        if np.float32(temperature) == 0:  # T under float32's least: the max's 0 / 0 is NaN; T -> 0 keeps it
            scaled = torch.where(logits == top, 0.0, scaled)
    w = weights(scaled)[1]
    total = _running_sum(np.sort(w)[::-1])  # equal weights are equal values: the ids' order cannot change a sum
    g = torch.Generator().manual_seed(draw_key(seed, position))
    r = torch.rand(1, generator=g, dtype=torch.float64).item()
    if top_p < 1.0:
        ids, cum = _head(w, lambda cum: cum[-1] >= top_p * total)
        keep = int(np.searchsorted(cum, top_p * total)) + 1
        u = r * float(cum[keep - 1])
    else:
        ids, cum = _head(w, lambda cum: cum[-1] > r * total)
        keep, u = len(cum), r * total
    return int(ids[min(int(np.searchsorted(cum[:keep], u, side="right")), keep - 1)])


def drawable(top: float, position: int) -> None:
    """A row whose largest logit is not finite has no distribution to draw from: a NaN or +inf in it (a penalty
    or bias that overflowed), or every token masked (-inf). An error for the stream, never a draw of noise."""
    if not math.isfinite(top):
        raise TfqError(f"the row for position {position} has no finite largest logit ({top}); nothing to draw from")


def _head(w: np.ndarray, enough) -> tuple[np.ndarray, np.ndarray]:
    """The first tokens of the order (by weight, then by id) and their running sums, as many as `enough` wants:
    the 64 largest weights and their ties, then 8 times more, up to all of them."""
    k = 64
    while True:
        ids = np.flatnonzero(w >= np.partition(w, len(w) - k)[len(w) - k]) if k < len(w) else np.arange(len(w))
        ids = ids[np.argsort(-w[ids], kind="stable")]  # ascending ids in, so a tie keeps the lower id first
        cum = np.cumsum(w[ids], dtype=np.float64)  # the prefix of the whole order's running sums, bit for bit
        if enough(cum) or len(ids) == len(w):
            return ids, cum
        k *= 8


def _running_sum(values: np.ndarray, block: int = BLOCK) -> float:
    """values added one after another in float64 (a cumsum's last entry), a block at a time."""
    total, buffer = 0.0, np.empty(block + 1)
    for start in range(0, len(values), block):
        part = values[start:start + block]
        buffer[0], buffer[1:len(part) + 1] = total, part
        total = float(np.cumsum(buffer[:len(part) + 1])[-1])
    return total


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under one logits row, and the row's `top` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first; ties: lower id


def log_softmax(logits: torch.Tensor) -> np.ndarray:
    """The row's log-softmax in float64: logit - max - log(sum of the weights), by the recipe of `weights`."""
    d, w = weights(logits)
    d -= log64(w.sum(dtype=np.float64))
    return d


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
