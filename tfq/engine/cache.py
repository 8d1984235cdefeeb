"""The KV cache: one row store per attention layer, K and V `[rows, kv_heads, head_dim]` in the cache dtype;
and a hybrid's recurrent state: per DeltaNet layer, one slot per lane.

Rows are handed out by the page pool (tfq/engine/pages.py): first the contiguous lanes, then the pages. Attention
only ever sees row indices (`rows`, `key_rows`), so a lane and a page list are read by the same code.

A DeltaNet layer keeps no rows: each stream's whole past is a fixed-size state (the recurrence's
[value_heads, key_dim, value_dim] and the convolution's last kernel - 1 inputs), in the slot of the lane the
stream holds. A stream's first row starts its slot from zeros, so a preempted stream recomputes its state from
scratch; a draft verify keeps the state from before its rows and their inputs, so rejected guesses roll back
(the state restored, the rows kept run again: tfq/model/qwen.py, `roll_back`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tfq.engine.pages import PagePool, Placement
from tfq.engine.resident import Ahead, zeros_as_written
from tfq.kernels.attention import tile_count
from tfq.kernels.contract import CACHE_DTYPES, KEY_TILE
from tfq.kernels.delta import NONE
from tfq.model.config import ModelConfig


@dataclass(frozen=True)
class CacheSpec:
    """A cache's rows and slots: also what another tensor-parallel rank needs to hold the same rows of its own heads
    (tfq/parallel/rank_main.py builds its cache from rank 0's)."""

    lanes: int  # contiguous lanes of `window` rows
    window: int
    page_rows: int = 0  # 0: no pages
    pool_pages: int = 0
    dtype: str = "fp32"  # CACHE_DTYPES
    slots: int = 0  # a hybrid's state slots, every lane's, contiguous or paged (0: one a contiguous lane)
    verify_rows: int = 0  # drafting: rows of a verify a slot can roll back
    snapshots: int = 0  # a hybrid with a prefix cache: states kept at full page boundaries (prefix_snapshots)


class KVCache:
    def __init__(self, config: ModelConfig, spec: CacheSpec, *, page_order_seed: int | None = None, backend=None,
                 prefix=None, snapshot_offset: int = 0):
        if backend is None:
            from tfq.kernels.backend import torch_backend
            backend = torch_backend()
        self.backend = backend  # tfq.kernels.backend.Backend: where the store lives and which kernel writes it
        self.spec = s = spec
        self.dtype_name = s.dtype
        self.dtype = CACHE_DTYPES[s.dtype]
        # prefix: tfq.engine.prefix.PrefixCache
        self.pages = PagePool(s.lanes, s.window, s.page_rows, s.pool_pages, page_order_seed, prefix)
        self.rows_total = self.pages.rows
        shape = (self.rows_total, config.num_kv_heads, config.head_dim)
        dev = backend.device
        layers = len(config.attention_layers)
        self.k = [zeros_as_written(shape, self.dtype, dev) for _ in range(layers)]
        self.v = [zeros_as_written(shape, self.dtype, dev) for _ in range(layers)]
        self.ahead = Ahead(self.k + self.v)  # a forward's rows resident before it writes them (its one caller)
        self.state = StateCache(config, s.slots or s.lanes, s.verify_rows, s.snapshots) if config.hybrid else None
        if self.state is not None and s.snapshots and prefix is not None:
            self.pages.keep_states(self.state, snapshot_offset)
        self._bound: dict = {}

    def bound(self, key, build):
        """What `build()` makes of this cache's tensors (a kernel's object holding them: the model's one object's
        lists, kernels/layer.py: bind_caches), built once under `key`: the tensors are made once, in __init__."""
        if key not in self._bound:
            self._bound[key] = build()
        return self._bound[key]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + (self.state.nbytes if self.state else 0)

    def keep_on_disk(self, folder: str, root: bytes, most_bytes: int) -> None:
        """Full pages the prefix cache names are kept in `folder` too, and found there again (tfq/engine/
        prefix_store.py); root: the prefix cache's, with the weights and the recipe."""
        from tfq.engine.prefix_store import PrefixStore, Shape

        shapes = [Shape.page(self.spec.page_rows, len(self.k), self.k[0].shape[1], self.k[0].shape[2], self.dtype)]
        if self.state is not None and self.spec.snapshots:
            shapes.append(Shape("state", tuple(tuple(t.shape[1:]) for t in self.state.conv + self.state.rec),
                                torch.float32))
        self.pages.keep_on_disk(PrefixStore(folder, root, shapes, most_bytes), self)

    def page_rows(self, page: int) -> list[torch.Tensor]:
        """A pool page's rows in every attention layer, keys then values of each (views of the store)."""
        start = self.pages.base + page * self.spec.page_rows
        rows = slice(start, start + self.spec.page_rows)
        return [t[rows] for k, v in zip(self.k, self.v) for t in (k, v)]

    def fill_page(self, page: int, rows: list[torch.Tensor]) -> None:
        """The page's rows in every layer, as `page_rows` lists them, from `rows` (a page read back from disk)."""
        for store, kept in zip(self.page_rows(page), rows):
            store.copy_(kept)

    def rows(self, p: Placement, start: int, count: int) -> torch.Tensor:
        """Store rows of positions [start, start + count)."""
        return torch.from_numpy(self.row_array(p, start, count))

    def key_rows(self, p: Placement, length: int) -> torch.Tensor:
        """Store rows of every key tile covering positions [0, length); the tail of the last tile stays
        inside the store (masked by attention, so any finite row serves)."""
        return torch.from_numpy(self.key_row_array(p, length))

    def row_array(self, p: Placement, start: int, count: int) -> np.ndarray:
        """`rows` as a numpy array (a forward's tables are built in numpy: each torch op costs microseconds cold,
        between forwards that streamed the weights through the caches). A decode step's few rows in Python's
        integers: five numpy ops cost tens of microseconds on those caches, every step."""
        if count <= 8:
            return np.array([p.row(i) for i in range(start, start + count)], dtype=np.int64)
        pos = np.arange(start, start + count)
        return np.asarray(p.blocks, dtype=np.int64)[pos // p.block_rows] + pos % p.block_rows

    def key_row_array(self, p: Placement, length: int) -> np.ndarray:
        padded = tile_count(length) * KEY_TILE
        if not p.paged:
            return np.minimum(p.blocks[0] + np.arange(padded), self.rows_total - 1)
        return self.row_array(p, 0, padded)  # page rows are a multiple of the tile: a tile never straddles pages

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend.store(self.k[layer], self.v[layer], rows.to(self.backend.device), k, v, self.dtype_name)

    def stored(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """What `write` left at `rows`, keys then values, as fp32 [N, 2 * kv_heads, head_dim] (for the guard)."""
        rows = rows.to(self.backend.device)
        return torch.cat([self.k[layer][rows].float(), self.v[layer][rows].float()], 1)


class StateCache:
    """A hybrid's per-stream state, fp32: for each DeltaNet layer a recurrent state [slots, value_heads, key_dim,
    value_dim] and a convolution window [slots, kernel - 1, channels]. With `verify_rows` (drafting), room to
    roll a verify back: each slot's state from before the verify, and the verify's inputs to the recurrence (its
    rows of in_proj's q, k, v channels, a and b). With `snapshots` (a prefix cache), that many states kept by the
    key of the full page they end (tfq/engine/prefix.py), least recently used replaced first: a later stream whose
    prompt starts with those pages starts its DeltaNet layers from there."""

    def __init__(self, config: ModelConfig, slots: int, verify_rows: int = 0, snapshots: int = 0):
        n, layers = config.deltanet, len(config.deltanet_layers)
        self.conv = [torch.zeros(slots, n.conv_kernel - 1, n.channels) for _ in range(layers)]
        self.rec = [torch.zeros(slots, n.value_heads, n.key_dim, n.value_dim) for _ in range(layers)]
        self.verify_rows = verify_rows
        keep = verify_rows > 0
        self.saved_conv = [torch.zeros_like(t) if keep else NONE for t in self.conv]
        self.saved_rec = [torch.zeros_like(t) if keep else NONE for t in self.rec]
        self.inputs = [(torch.zeros(slots, verify_rows, n.channels), torch.zeros(slots, verify_rows, n.value_heads),
                        torch.zeros(slots, verify_rows, n.value_heads)) if keep else () for _ in range(layers)]
        self.kept_conv = [torch.zeros(snapshots, *t.shape[1:]) for t in self.conv]
        self.kept_rec = [torch.zeros(snapshots, *t.shape[1:]) for t in self.rec]
        self.kept: OrderedDict[bytes, int] = OrderedDict()  # page key -> its snapshot, least recently used first
        self.spare = list(range(snapshots))

    def has(self, key: bytes) -> bool:
        return key in self.kept

    def keep(self, key: bytes, slot: int) -> None:
        """The slot's state as it is now (after the rows the page `key` ends), kept under that key."""
        self.take(key, [state[slot] for state in self.conv + self.rec])

    def kept_state(self, key: bytes) -> list[torch.Tensor]:
        """The state kept under `key`: each layer's convolution window, then each layer's recurrence (views)."""
        at = self.kept[key]
        return [t[at] for t in self.kept_conv + self.kept_rec]

    def take(self, key: bytes, state: list[torch.Tensor]) -> None:
        """`state` (as `kept_state` lists it: a slot's, or one read back from disk) copied and kept under `key`,
        in a spare snapshot or the least recently used one."""
        if key in self.kept or not (self.spare or self.kept):
            return
        at = self.spare.pop() if self.spare else self.kept.popitem(last=False)[1]
        for kept, t in zip(self.kept_conv + self.kept_rec, state):
            kept[at].copy_(t)
        self.kept[key] = at

    def resume(self, key: bytes, slot: int) -> None:
        """The slot starts from the state kept under `key`."""
        at = self.kept[key]
        self.kept.move_to_end(key)
        for kept, state in zip(self.kept_conv + self.kept_rec, self.conv + self.rec):
            state[slot].copy_(kept[at])

    @property
    def nbytes(self) -> int:
        tensors = (self.conv + self.rec + self.saved_conv + self.saved_rec + [t for i in self.inputs for t in i]
                   + self.kept_conv + self.kept_rec)
        return sum(t.numel() * t.element_size() for t in tensors)

    def keep_inputs(self, index: int, segments, x: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor) -> None:
        """Layer `index`'s inputs of the segments marked to save (a verify's rows), by their slots. segments:
        tfq.engine.batch.Segments."""
        for s in segments:
            if s.save:
                for kept, t in zip(self.inputs[index], (x, a, b)):
                    kept[s.slot, :s.rows] = t[s.first:s.first + s.rows]

    def restore(self, slot: int) -> None:
        """The slot's states as they were before the verify that last ran in it."""
        for state, saved in zip(self.conv + self.rec, self.saved_conv + self.saved_rec):
            state[slot].copy_(saved[slot])

    def copy(self, source: int, target: int) -> None:
        """Slot `source`'s state into slot `target` (a drafter's checkpoint)."""
        for state in self.conv + self.rec:
            state[target].copy_(state[source])

    def fingerprint(self, index: int, segments, rows: int) -> torch.Tensor:
        """[rows, 8] fp32: for each row, an exact fingerprint of its stream's state in layer `index` after the
        forward (the start-up guard compares it; a float sum would round, so the bits are summed as integers,
        weighted by position, and the 64-bit sums split into 16-bit pieces that fp32 holds exactly)."""
        out = torch.zeros(rows, 8)
        for s in segments:
            sums = [_bit_sum(t[s.slot]) for t in (self.conv[index], self.rec[index])]
            out[s.first:s.first + s.rows] = torch.tensor([(s >> (16 * i)) & 0xFFFF for s in sums for i in range(4)],
                                                  dtype=torch.float32)
        return out


def _bit_sum(t: torch.Tensor) -> int:
    """sum of (bits of element i) * (i + 1), modulo 2^64: equal states give equal sums, any one bit changed
    changes it."""
    bits = t.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
    return int((bits * weights).sum()) & 0xFFFFFFFFFFFFFFFF
