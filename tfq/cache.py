"""The KV cache: one row store per layer, K and V `[rows, kv_heads, head_dim]` in the cache dtype.

Rows are handed out by the page pool (tfq/pages.py): first the contiguous lanes, then the pages. Attention
only ever sees row indices (`rows`, `key_rows`), so a lane and a page list are read by the same code.
"""
from __future__ import annotations

import torch

from tfq.kernels.attention import tile_count
from tfq.kernels.contract import CACHE_DTYPES, KEY_TILE
from tfq.model.config import ModelConfig
from tfq.pages import PagePool, Placement


class KVCache:
    def __init__(self, config: ModelConfig, *, lanes: int, window: int, page_rows: int = 0, pool_pages: int = 0,
                 dtype: str = "fp32", page_order_seed: int | None = None, backend=None, prefix=None):
        if backend is None:
            from tfq.kernels.backend import torch_backend
            backend = torch_backend()
        self.backend = backend  # tfq.kernels.backend.Backend: where the store lives and which kernel writes it
        self.dtype_name = dtype
        self.dtype = CACHE_DTYPES[dtype]
        self.pages = PagePool(lanes, window, page_rows, pool_pages, page_order_seed, prefix)  # prefix: PrefixCache
        self.rows_total = self.pages.rows
        shape = (self.rows_total, config.num_kv_heads, config.head_dim)
        dev = backend.device
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rows(self, p: Placement, start: int, count: int) -> torch.Tensor:
        """Store rows of positions [start, start + count)."""
        pos = torch.arange(start, start + count)
        blocks = torch.tensor(p.blocks, dtype=torch.long)
        return blocks[pos // p.block_rows] + pos % p.block_rows

    def key_rows(self, p: Placement, length: int) -> torch.Tensor:
        """Store rows of every key tile covering positions [0, length); the tail of the last tile stays
        inside the store (masked by attention, so any finite row serves)."""
        padded = tile_count(length) * KEY_TILE
        if not p.paged:
            return (p.blocks[0] + torch.arange(padded)).clamp_(max=self.rows_total - 1)
        return self.rows(p, 0, padded)  # page rows are a multiple of the tile: a tile never straddles pages

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend.store(self.k[layer], self.v[layer], rows.to(self.backend.device), k, v, self.dtype_name)

    def stored(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """What `write` left at `rows`, keys then values, as fp32 [N, 2 * kv_heads, head_dim] (for the guard)."""
        rows = rows.to(self.backend.device)
        return torch.cat([self.k[layer][rows].float(), self.v[layer][rows].float()], 1)
