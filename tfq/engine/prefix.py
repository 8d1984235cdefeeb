"""The prefix cache: full pages of streams' caches, found again by their content.

A cached row's bits are a function of the tokens up to it and of the arithmetic, never of the forward that
computed it (a row is computed the same way alone, in a chunk or beside other streams). So a full page can be
named by a hash of every token up to its end, chained page by page from a root that holds what else decides
the bits (the model, the cache dtype, the arithmetic), and a stream whose tokens start the same way can map
that page instead of computing it: the rows it reads are the rows it would have written.

The cache only names pages; the page pool (tfq/engine/pages.py) owns them. A named page that no stream holds stays
cached, idle, until the pool needs a page: then the least recently used idle page is forgotten and reused.
A page a stream holds is never evicted, and is never written again: a stream writes only positions past the
pages it mapped.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a page holding `tokens`, after the page keyed `parent` (or the root)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def root_key(*facts: object) -> bytes:
    """The chain's root: what besides the tokens decides a row's bits."""
    return hashlib.blake2b(repr(facts).encode(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, root: bytes):
        self.root = root
        self.page_of: dict[bytes, int] = {}  # key -> page holding those rows
        self.key_of: dict[int, bytes] = {}  # page -> its key
        self.idle: OrderedDict[int, None] = OrderedDict()  # named pages no stream holds, least recently used first
        self.reused_rows = 0  # prompt tokens streams took from the cache instead of computing, in all

    def root_of(self, salt: str) -> bytes:
        """The root of the chains a salt's streams find and name: tenants with other salts never share a page
        (their rows would be the same bits; whether another tenant has sent a prompt is not theirs to learn)."""
        return self.root if not salt else page_key(self.root + salt.encode(), [])

    def find(self, key: bytes) -> int | None:
        return self.page_of.get(key)

    def name(self, page: int, key: bytes) -> None:
        """`page` now holds the rows `key` names; a key already held by another page keeps that page."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def named(self, page: int) -> bool:
        return page in self.key_of

    def park(self, page: int) -> None:
        """No stream holds this named page any more: keep it, most recently used."""
        self.idle[page] = None
        self.idle.move_to_end(page)

    def unpark(self, page: int) -> None:
        self.idle.pop(page, None)

    def evict(self) -> int:
        """The least recently used idle page, forgotten, for the pool to reuse."""
        page, _ = self.idle.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        return page
