"""Who holds which rows of the KV store: contiguous lanes, and a pool of pages handed out and taken back.

The store (tfq/cache.py) is `lanes x window` rows of lanes, then `pool_pages x page_rows` rows of pages. A
stream's placement maps its positions to store rows: a lane is one block of `window` rows, a paged stream a
list of pages in any order. Which pages a stream gets never matters to its bits (attention reads through
row indices), so tests shuffle the pool.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


def pages_for(rows: int, page_rows: int) -> int:
    """Pages that hold `rows` rows (the last one partly); the plan's layout counts with it too."""
    return -(-rows // page_rows)


@dataclass
class Placement:
    """Where a stream's cached positions live: block b covers positions [b*block_rows, (b+1)*block_rows)."""

    block_rows: int
    blocks: list[int] = field(default_factory=list)  # first store row of each block
    paged: bool = False
    pages: list[int] = field(default_factory=list)  # page ids (paged only)

    @property
    def capacity(self) -> int:
        return self.block_rows * len(self.blocks)


class PagePool:
    def __init__(self, lanes: int, window: int, page_rows: int = 0, pool_pages: int = 0,
                 order_seed: int | None = None):
        self.window, self.page_rows, self.pool_pages = window, page_rows, pool_pages
        self.base = lanes * window  # first store row of the pool
        self.free = list(range(pool_pages))
        if order_seed is not None:  # which page ids a stream gets must not matter; tests shuffle them
            random.Random(order_seed).shuffle(self.free)

    @property
    def rows(self) -> int:
        """Store rows in all: the lanes, then the pool."""
        return self.base + self.pool_pages * self.page_rows

    def lane(self, i: int) -> Placement:
        return Placement(self.window, [i * self.window])

    def paged(self) -> Placement:
        return Placement(self.page_rows, paged=True)

    def grow(self, p: Placement, rows: int) -> bool:
        """Make room for positions [0, rows). False (taking nothing more) when the pool is dry."""
        if not p.paged:
            return rows <= p.capacity
        need = pages_for(rows, self.page_rows) - len(p.pages)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            page = self.free.pop()
            p.pages.append(page)
            p.blocks.append(self.base + page * self.page_rows)
        return True

    def shrink(self, p: Placement, rows: int) -> None:
        """Give back the pages past those holding positions [0, rows) (rows a verify forward rejected)."""
        if not p.paged:
            return
        keep = pages_for(rows, self.page_rows)
        while len(p.pages) > keep:
            self.free.append(p.pages.pop())
            p.blocks.pop()

    def release(self, p: Placement) -> None:
        self.free.extend(reversed(p.pages))
        p.pages.clear()
        p.blocks.clear()
