"""Freed heap given back to the OS. glibc keeps memory freed in the middle of its heap (a load's temporaries
between the weights it keeps, a proof's tensors): resident, though nothing holds it, and a resident-memory count
(a bench's peak, a machine's limit) counts it. `malloc_trim` returns those pages; elsewhere this does nothing."""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def _trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): its allocator decides
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def give_back() -> None:
    """Return the heap's free pages to the OS (milliseconds; call it after work that freed much)."""
    trim = _trim()
    if trim is not None:
        trim(0)
