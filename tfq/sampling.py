"""Choosing the next token from one stream's fp32 logits: a function of the row, the settings and the position.

Greedy is argmax (the lowest id wins a tie). With temperature > 0 each draw uses its own generator keyed by
(seed, position): no global RNG, so a stream draws the same token alone, batched, drafted or recomputed.
"""
from __future__ import annotations

import hashlib

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
    probs = torch.softmax(logits / temperature, -1)
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
