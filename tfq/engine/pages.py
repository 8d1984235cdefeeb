"""Who holds which rows of the KV store: contiguous lanes, and a pool of pages handed out and taken back.

The store (tfq/engine/cache.py) is `lanes x window` rows of lanes, then `pool_pages x page_rows` rows of pages. A
stream's placement maps its positions to store rows: a lane is one block of `window` rows, a paged stream a
list of pages in any order. Which pages a stream gets never matters to its bits (attention reads through
row indices), so tests shuffle the pool.

With a prefix cache (tfq/engine/prefix.py) a page can be held by several streams at once (its reference count), and a
full page keeps its rows after its last stream lets go, until the pool needs it back.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tfq.engine.prefix import PrefixCache, page_key
from tfq.plan.layout import pages_for


@dataclass
class Placement:
    """Where a stream's cached positions live: block b covers positions [b*block_rows, (b+1)*block_rows)."""

    block_rows: int
    blocks: list[int] = field(default_factory=list)  # first store row of each block
    paged: bool = False
    pages: list[int] = field(default_factory=list)  # page ids (paged only)
    keys: list[bytes] = field(default_factory=list)  # with a prefix cache: the keys of its first full pages
    root: bytes = b""  # with a prefix cache: the root its keys chain from (its stream's cache salt's)
    slot: int = 0  # the lane it belongs to: where a hybrid keeps the stream's recurrent state

    @property
    def capacity(self) -> int:
        return self.block_rows * len(self.blocks)

    def row(self, position: int) -> int:
        """The store row holding `position`."""
        return self.blocks[position // self.block_rows] + position % self.block_rows


class PagePool:
    def __init__(self, lanes: int, window: int, page_rows: int = 0, pool_pages: int = 0,
                 order_seed: int | None = None, prefix: PrefixCache | None = None):
        self.window, self.page_rows, self.pool_pages = window, page_rows, pool_pages
        self.base = lanes * window  # first store row of the pool
        self.free = list(range(pool_pages))  # pages holding nothing worth keeping
        if order_seed is not None:  # which page ids a stream gets must not matter; tests shuffle them
            random.Random(order_seed).shuffle(self.free)
        self.refs = [0] * pool_pages  # streams holding each page
        self.prefix = prefix
        self.store = None  # tfq.engine.prefix_store.PrefixStore: named pages kept on disk too
        self.rows_of = None  # what holds the pages' rows (tfq.engine.cache.KVCache: page_rows, fill_page)
        self.states = None  # tfq.engine.cache.StateCache: a hybrid's DeltaNet states kept at page boundaries
        self.snapshot_offset = 0  # rows past its boundary a state is kept at: 0; a check's control sets 1

    def keep_on_disk(self, store, rows_of) -> None:
        self.store, self.rows_of = store, rows_of

    def keep_states(self, states, offset: int = 0) -> None:
        """A hybrid's prefix cache: its streams' DeltaNet states kept where they fill a page (`states.keep`), so a
        stream that maps pages starts its DeltaNet layers from the state at the last one."""
        self.states, self.snapshot_offset = states, offset

    def boundary(self, cached: int) -> int | None:
        """Where a stream with `cached` rows should end its next chunk so that its state can be kept there (the
        next page boundary); None when no state is kept."""
        if self.states is None:
            return None
        rows, off = self.page_rows, self.snapshot_offset
        return ((cached - off) // rows + 1) * rows + off

    @property
    def rows(self) -> int:
        """Store rows in all: the lanes, then the pool."""
        return self.base + self.pool_pages * self.page_rows

    @property
    def available(self) -> int:
        """Pages a stream may take: the free ones, and cached pages no stream holds."""
        return len(self.free) + (len(self.prefix.idle) if self.prefix else 0)

    @property
    def unheld(self) -> int:
        """Pages no stream holds (free or cached): the whole pool once every stream is done."""
        return self.refs.count(0)

    def lane(self, i: int) -> Placement:
        return Placement(self.window, [i * self.window], slot=i)

    def paged(self, slot: int = 0, salt: str = "") -> Placement:
        """A paged placement; with a prefix cache, its pages chain from the root of the stream's cache salt."""
        return Placement(self.page_rows, paged=True, slot=slot,
                         root=self.prefix.root_of(salt) if self.prefix is not None else b"")

    def grow(self, p: Placement, rows: int) -> bool:
        """Make room for positions [0, rows). False (taking nothing more) when the pool is dry."""
        if not p.paged:
            return rows <= p.capacity
        need = pages_for(rows, self.page_rows) - len(p.pages)
        if need > self.available:
            return False
        for _ in range(max(need, 0)):
            self._hold(p, self.free.pop() if self.free else self.prefix.evict())
        return True

    def shrink(self, p: Placement, rows: int) -> None:
        """Give back the pages past those holding positions [0, rows) (rows a verify forward rejected)."""
        if not p.paged:
            return
        keep = pages_for(rows, self.page_rows)
        while len(p.pages) > keep:
            self._let_go(p.pages.pop())
            p.blocks.pop()

    def release(self, p: Placement) -> None:
        for page in reversed(p.pages):
            self._let_go(page)
        p.pages.clear()
        p.blocks.clear()
        p.keys.clear()

    # -- the prefix cache ---------------------------------------------------------------------------------
    def adopt(self, p: Placement, tokens: list[int]) -> int:
        """Map the cached full pages that start `tokens` (under the placement's root) into an empty placement;
        the rows they hold. The last token is never taken: a stream draws from its own last row, so it computes
        at least that one. A hybrid maps pages up to the last one whose DeltaNet state is kept, and its slot starts
        from that state."""
        if self.prefix is None or not p.paged or p.pages:
            return 0
        keys, parent = [], p.root
        for i in range((len(tokens) - 1) // self.page_rows):
            key = page_key(parent, tokens[i * self.page_rows:(i + 1) * self.page_rows])
            if self.prefix.find(key) is None and not (self.store is not None and self.store.has(key)):
                break
            keys.append(key)
            parent = key
        if self.states is not None:  # rows past the last kept state would start the recurrence from nothing
            while keys and not self._state_at(keys[-1]):
                keys.pop()
        for key in keys:
            page = self.prefix.find(key)
            if page is None:
                page = self._from_disk(key)
            if page is None:
                break
            self.prefix.unpark(page)
            self._hold(p, page)
            p.keys.append(key)
        if self.states is not None:
            while p.keys and not self.states.has(p.keys[-1]):  # a page read from disk failed past the last state
                self._let_go(p.pages.pop())
                p.blocks.pop()
                p.keys.pop()
            if p.keys:
                self.states.resume(p.keys[-1], p.slot)
        rows = len(p.pages) * self.page_rows
        self.prefix.reused_rows += rows
        return rows

    def publish(self, p: Placement, tokens: list[int], cached: int, state_now: bool = False) -> None:
        """Name the placement's pages that `cached` rows fill, so later streams can find them. state_now: the
        stream's DeltaNet state is the one after exactly `cached` rows (its forward held no guesses), so a hybrid
        keeps it when `cached` ends a page."""
        if self.prefix is None or not p.paged:
            return
        for i in range(len(p.keys), cached // self.page_rows):
            key = page_key(p.keys[-1] if p.keys else p.root,
                           tokens[i * self.page_rows:(i + 1) * self.page_rows])
            p.keys.append(key)
            self.prefix.name(p.pages[i], key)
            if self.store is not None:
                self.store.save(key, self.rows_of.page_rows(p.pages[i]))
        ended = cached - self.snapshot_offset  # the rows a state kept now is named for (a control moves it)
        if self.states is not None and state_now and ended > 0 and ended % self.page_rows == 0:
            key = p.keys[ended // self.page_rows - 1]
            self.states.keep(key, p.slot)
            if self.store is not None and self.states.has(key):
                self.store.save(key, self.states.kept_state(key), "state")

    def _state_at(self, key: bytes) -> bool:
        """Whether a hybrid's state after the page `key` is kept: in memory, or on disk (read back into memory)."""
        if self.states.has(key):
            return True
        state = self.store.load(key, "state") if self.store is not None and self.store.has(key, "state") else None
        if state is not None:
            self.states.take(key, state)
        return self.states.has(key)

    def _from_disk(self, key: bytes) -> int | None:
        """A page the store kept under `key`, read into a page of the pool and named (None: not kept, damaged, or
        no page to put it in)."""
        if self.store is None or not self.available or not self.store.has(key):
            return None
        rows = self.store.load(key)
        if rows is None:
            return None
        page = self.free.pop() if self.free else self.prefix.evict()
        self.rows_of.fill_page(page, rows)
        self.prefix.name(page, key)
        return page

    def _hold(self, p: Placement, page: int) -> None:
        self.refs[page] += 1
        p.pages.append(page)
        p.blocks.append(self.base + page * self.page_rows)

    def _let_go(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page]:
            return
        if self.prefix is not None and self.prefix.named(page):
            self.prefix.park(page)
        else:
            self.free.append(page)
