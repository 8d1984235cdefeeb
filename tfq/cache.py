"""The KV cache: contiguous lanes and a pool of pages, in one row store per layer.

Per layer, K and V are `[rows_total, kv_heads, head_dim]` tensors in the cache dtype: first the contiguous
lanes (`window` rows each), then the pool (`pool_pages` pages of `page_rows` rows). A stream's placement
maps its positions to rows of that store: a lane is one block of `window` rows, a paged stream a list of
pages. Attention only ever sees the row indices (`rows`), so both are read by the same code.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tfq.model.config import ModelConfig
from tfq.kernels.contract import CACHE_DTYPES, KEY_TILE


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


class KVCache:
    def __init__(self, config: ModelConfig, *, lanes: int, window: int, page_rows: int = 0, pool_pages: int = 0,
                 dtype: str = "fp32", page_order_seed: int | None = None, backend=None):
        if backend is None:
            from tfq.kernels.backend import torch_backend
            backend = torch_backend()
        self.backend = backend  # kernels.backend.Backend: where the store lives and which kernel writes it
        self.dtype_name = dtype
        self.dtype = CACHE_DTYPES[dtype]
        self.window = window
        self.lanes = lanes
        self.page_rows = page_rows
        self.pool_pages = pool_pages
        self.pool_base = lanes * window
        self.rows_total = self.pool_base + pool_pages * page_rows
        shape = (self.rows_total, config.num_kv_heads, config.head_dim)
        dev = backend.device
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(config.num_layers)]
        self.free_pages = list(range(pool_pages))
        if page_order_seed is not None:  # which page ids a stream gets must not matter; tests shuffle them
            random.Random(page_order_seed).shuffle(self.free_pages)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def lane(self, i: int) -> Placement:
        return Placement(self.window, [i * self.window])

    def paged(self) -> Placement:
        return Placement(self.page_rows, paged=True)

    def grow(self, p: Placement, rows: int) -> bool:
        """Make room for positions [0, rows). False (taking nothing more) when the pool is dry."""
        if not p.paged:
            return rows <= p.capacity
        need = -(-rows // self.page_rows) - len(p.pages)
        if need > len(self.free_pages):
            return False
        for _ in range(max(need, 0)):
            page = self.free_pages.pop()
            p.pages.append(page)
            p.blocks.append(self.pool_base + page * self.page_rows)
        return True

    def shrink(self, p: Placement, rows: int) -> None:
        """Give back the pages past those holding positions [0, rows) (rows a verify forward rejected)."""
        if not p.paged:
            return
        keep = -(-rows // self.page_rows)
        while len(p.pages) > keep:
            self.free_pages.append(p.pages.pop())
            p.blocks.pop()

    def release(self, p: Placement) -> None:
        self.free_pages.extend(reversed(p.pages))
        p.pages.clear()
        p.blocks.clear()

    def rows(self, p: Placement, start: int, count: int) -> torch.Tensor:
        """Store rows of positions [start, start + count)."""
        pos = torch.arange(start, start + count)
        blocks = torch.tensor(p.blocks, dtype=torch.long)
        return blocks[pos // p.block_rows] + pos % p.block_rows

    def key_rows(self, p: Placement, length: int) -> torch.Tensor:
        """Store rows of every key tile covering positions [0, length); the tail of the last tile stays
        inside the store (masked by attention, so any finite row serves)."""
        padded = -(-length // KEY_TILE) * KEY_TILE
        if not p.paged:
            return (p.blocks[0] + torch.arange(padded)).clamp_(max=self.rows_total - 1)
        return self.rows(p, 0, padded)  # page rows are a multiple of the tile: a tile never straddles pages

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend.store(self.k[layer], self.v[layer], rows.to(self.backend.device), k, v, self.dtype_name)

    def stored(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """What `write` left at `rows`, keys then values, as fp32 [N, 2 * kv_heads, head_dim] (for the guard)."""
        rows = rows.to(self.backend.device)
        return torch.cat([self.k[layer][rows].float(), self.v[layer][rows].float()], 1)
