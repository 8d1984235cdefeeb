"""The kernel check's settings: shapes, stream lengths, repeats, seed, and which cache dtypes and kernels."""
from __future__ import annotations

from dataclasses import dataclass

from tfq.errors import TfqError
from tfq.kernels.contract import CACHE_DTYPES as DTYPES
from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS

KERNELS = ("rows", "partial", "rowwise")


@dataclass
class CheckConfig:
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    lengths: tuple[int, ...] = (5, 130, 290)
    page_rows: int = KEY_TILE
    chunk_rows: int = 8
    repeats: int = 5
    seed: int = 0
    dtypes: tuple[str, ...] = tuple(DTYPES)
    kernels: tuple[str, ...] = ("rows", "partial", "rowwise")  # rowwise: the linear layers and RMS norm

    def validate(self) -> None:
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise TfqError(f"--heads {self.heads} must be a positive multiple of --kv-heads {self.kv_heads}")
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise TfqError(f"--head-dim {self.head_dim} must be a power of two, at least 16")
        if self.page_rows < KEY_TILE or self.page_rows % KEY_TILE:
            raise TfqError(f"--page-rows {self.page_rows} must be a multiple of the key tile ({KEY_TILE})")
        if not self.lengths or min(self.lengths) < 1:
            raise TfqError("--lengths needs positive stream lengths, e.g. 5,130,290")
        if max(self.lengths) <= max(SPLIT_ROWS, self.page_rows):
            raise TfqError(f"--lengths needs one stream longer than {max(SPLIT_ROWS, self.page_rows)} rows (two "
                           "splits and two pages, for the controls), e.g. 5,130,290")
        if self.chunk_rows < 2 or self.repeats < 1:
            raise TfqError("--chunk-rows must be at least 2 and --repeats at least 1")
        for d in self.dtypes:
            if d not in DTYPES:
                raise TfqError(f"unknown cache dtype {d!r}; choose from {', '.join(DTYPES)}")
        for k in self.kernels:
            if k not in KERNELS:
                raise TfqError(f"unknown kernel {k!r}; choose {', '.join(KERNELS)}")

    @property
    def attention(self) -> tuple[str, ...]:
        return tuple(k for k in self.kernels if k in ("rows", "partial"))
