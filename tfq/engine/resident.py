"""When a KV cache's row stores take memory: as rows are written, and a chunk of rows before a forward writes them.

On the CPU each store is an anonymous mapping whose pages the OS hands out zeroed on first write
(`zeros_as_written`), so a chat that fills a hundred rows of a 4,096-row window holds those rows, not the window.
A page taken by a fault inside a kernel is dear, though: 3 to 9 us a page on a 2-core VM (docs/measurements.md),
and a decode step of a 14B model starts a page in each of its 80 stores every token (a row of 8 heads of 128 floats
is a page). So before a forward the chunks of rows it writes that are not resident yet are taken in one call a
store (`Ahead`: Linux's madvise(MADV_POPULATE_WRITE), about a third of a fault's cost a page): a store then holds
at most a chunk (64 KiB) more than its rows written, for each stream writing into it. The pages hold zeros either
way: no value changes.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; where it is refused, pages come by faults as before
CHUNK_BYTES = 64 << 10  # a store's rows made resident together


def zeros_as_written(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose memory becomes resident as rows are written: on the CPU an anonymous mapping, whose pages the OS
    hands out zeroed on first touch, instead of zeros filled up front. The values are zeros either way."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = int(np.prod(shape))
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: a forked process gets its own copy, as it would of torch's memory (page-aligned; the tensor holds it)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def _madvise():
    """libc's madvise(address, length, advice), or None where there is no Linux to ask."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes, call.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return call


class Ahead:
    """The chunks of rows made resident in every store of one cache (`zeros_as_written`'s, rows first, all of one
    row size), before the forwards that write them. One owner: the cache."""

    def __init__(self, stores: list[torch.Tensor]):
        self.stores = [(t.data_ptr(), t.nbytes) for t in stores if t.device.type == "cpu" and t.nbytes]
        self.row_bytes = stores[0].nbytes // stores[0].shape[0] if self.stores else 0
        self.rows = max(1, CHUNK_BYTES // max(1, self.row_bytes))  # rows a chunk
        self.span = self.rows * self.row_bytes  # a chunk's bytes
        self.taken: set[int] = set()  # chunks made resident
        self.madvise = _madvise() if self.stores else None

    def before(self, rows: np.ndarray) -> None:
        """Every chunk holding one of `rows` (store rows a forward is about to write) resident in every store."""
        if self.madvise is None:
            return
        for chunk in {r // self.rows for r in rows.tolist()} - self.taken:  # a decode step: one row a lane
            self.taken.add(chunk)
            page = mmap.PAGESIZE
            start = chunk * self.span // page * page
            end = -(-(chunk + 1) * self.span // page) * page
            for address, size in self.stores:
                if start < size and self.madvise(address + start, min(end, size) - start, MADV_POPULATE_WRITE):
                    self.madvise = None  # refused (a kernel before 5.14): faults take the pages, as before
                    return
