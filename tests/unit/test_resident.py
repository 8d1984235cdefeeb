"""A KV cache's row stores become resident as rows are written (tfq/engine/cache.py: zeros_as_written): a chat
that fills a hundred rows of a 4,096-row window holds those rows, and every row reads zeros until written."""
import sys

import pytest
import torch

from tfq.engine.cache import zeros_as_written
from tiny import resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")

MiB = 2**20


def test_a_row_store_is_zeros_and_resident_only_where_written():
    store = zeros_as_written((8192, 16, 128), torch.float32, torch.device("cpu"))  # 64 MiB
    assert resident_bytes(store.data_ptr(), store.nbytes) == 0
    store[0] = 1.0
    assert 0 < resident_bytes(store.data_ptr(), store.nbytes) <= 2 * MiB  # a page (or a huge page)
    assert store.data_ptr() % 64 == 0 and store.dtype == torch.float32 and store.shape == (8192, 16, 128)
    assert torch.equal(store[1:], torch.zeros(8191, 16, 128))  # the rows not written read zeros
    assert mapping_flags(store.data_ptr()).endswith("p")  # private: a forked process writes its own copy


def mapping_flags(address: int) -> str:
    """The permissions of the mapping holding `address` (/proc/self/maps: rw-p private, rw-s shared)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, flags = line.split()[:2]
            start, end = (int(a, 16) for a in span.split("-"))
            if start <= address < end:
                return flags
    raise AssertionError(f"no mapping holds {address:#x}")


def test_control_a_store_written_whole_is_resident_whole():
    store = zeros_as_written((8192, 16, 128), torch.float32, torch.device("cpu"))
    store.fill_(0.0)  # every row written (with the zeros it holds): every page taken
    assert resident_bytes(store.data_ptr(), store.nbytes) >= 64 * MiB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_every_cache_dtype_comes_as_zeros(dtype):
    store = zeros_as_written((64, 2, 64), dtype, torch.device("cpu"))
    assert store.dtype == dtype and torch.equal(store.float(), torch.zeros(64, 2, 64))
