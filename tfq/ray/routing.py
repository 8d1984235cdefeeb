"""Which replica a request goes to: the one its prompt's first full page hashes to, unless that one is busier than
the others by more than a bound.

A replica's prefix cache holds full pages found again by their tokens (tfq/engine/prefix.py), so prompts that share
a first page share the work only where they land together. Each replica id gets a score from the page's key
(rendezvous hashing): the highest score wins, every router computes the same answer with no state shared, and a
replica that joins or leaves moves only the keys it wins or held. A prompt shorter than a page has no key: it goes
by load alone. Nothing here changes a reply's bits (every replica gives the same ones); it changes where the work is
done and how much of it is done again.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

BUSIER_BY = 4  # requests: a preferred replica this far above the least busy one loses its claim


def route_key(prompt: Sequence[int], page_rows: int) -> str | None:
    """The key of a prompt's first full page of `page_rows` tokens; None when the prompt is shorter (or the plan
    keeps no pages)."""
    if page_rows <= 0 or len(prompt) < page_rows:
        return None
    return hashlib.blake2b(",".join(map(str, prompt[:page_rows])).encode(), digest_size=8).hexdigest()


def _score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


def ranked(replicas: Sequence[str], key: str | None, load: dict[str, int] | None = None,
           busier_by: int = BUSIER_BY) -> list[list[str]]:
    """Replica ids in ranks, most preferred first (Ray Serve's router takes the least busy of a rank that accepts):
    the key's replica alone, then the rest; or all in one rank where there is no key or the key's replica is busier
    than the least busy by more than `busier_by`."""
    if not replicas:
        return []
    if key is None:
        return [list(replicas)]
    order = sorted(replicas, key=lambda r: _score(key, r), reverse=True)
    load = load or {}
    least = min(load.get(r, 0) for r in replicas)
    if load.get(order[0], 0) - least > busier_by:
        return [order]
    return [order[:1], order[1:]] if len(order) > 1 else [order]
