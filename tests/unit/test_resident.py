"""A KV cache's row stores become resident as rows are written (tfq/engine/resident.py): a chat that fills a
hundred rows of a 4,096-row window holds those rows (and at most a chunk more a store, taken ahead of the forward
that writes them), and every row reads zeros until written."""
import mmap
import sys

import numpy as np
import pytest
import torch

from tfq.engine.resident import CHUNK_BYTES, Ahead, zeros_as_written
from tiny import resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")

MiB = 2**20
PAGE = mmap.PAGESIZE


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


def test_rows_a_forward_writes_are_resident_before_it_writes_them():
    """Ahead (tfq/engine/resident.py) takes the chunk holding each row a forward will write, in every store, before
    it writes: whole chunks, nothing beyond them, zeros still; rows whose bytes do not divide a page, the last
    chunk cut by the store's end. The control: the same calls with the pages left to faults leave nothing
    resident, so the check tells one from the other."""
    for heads, dim, rows in ((8, 128, 100), (3, 128, 301), (2, 64, 1000)):  # 4 KiB, 1.5 KiB and 512 B a row
        stores = [zeros_as_written((rows, heads, dim), torch.float32, torch.device("cpu")) for _ in range(3)]
        ahead = Ahead(stores)
        wanted = [0, ahead.rows - 1, ahead.rows, rows - 1]  # a chunk's first and last rows, the store's last
        ahead.before(np.array(wanted, dtype=np.int64))
        if ahead.madvise is None:
            pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux before 5.14): pages come by faults")
        row = heads * dim * 4
        for store in stores:
            for r in wanted:
                assert resident_bytes(store.data_ptr() + r * row, row) >= row, (heads, dim, r)
            chunks = len({r // ahead.rows for r in wanted})
            assert resident_bytes(store.data_ptr(), store.nbytes) <= chunks * (CHUNK_BYTES + 2 * PAGE)
            assert torch.equal(store, torch.zeros_like(store))
    control = zeros_as_written((100, 8, 128), torch.float32, torch.device("cpu"))
    refused = Ahead([control])
    refused.madvise = None  # as where the kernel refuses: faults take the pages when written
    refused.before(np.array([0, 50], dtype=np.int64))
    assert resident_bytes(control.data_ptr(), control.nbytes) == 0


def test_a_chats_stores_hold_the_chunks_of_its_rows():
    """An engine's forwards (tfq/engine/batch.py: forward) take their rows' chunks ahead in every store: after
    chats in a lane and on pages, the values store (which the stub model never writes or reads: only Ahead makes it
    resident) holds exactly the chunks holding a row written into the keys store. The control: the same chats with
    Ahead turned off leave the values store empty."""
    from dataclasses import replace

    from stub_model import StubModel
    from tfq.engine.core import Engine, EngineSettings
    from tfq.engine.stream import Request

    def chats(ahead_on: bool):
        model = StubModel()
        model.config = replace(model.config, num_kv_heads=8, head_dim=128)  # 4 KiB a row: 16 rows a chunk
        engine = Engine(model, EngineSettings(window=256, lanes=1, page_rows=16, pool_pages=24), eos_ids=())
        cache = engine.runner.cache
        if not ahead_on:
            cache.ahead.madvise = None
        engine.generate([Request(tuple(range(1, n + 1)), max_tokens=t) for n, t in ((40, 30), (70, 12), (5, 60))])
        return cache

    cache = chats(True)
    if cache.ahead.madvise is None:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux before 5.14): pages come by faults")
    written = (cache.k[0][:, 0, 1] != 0).nonzero().flatten().tolist()  # the stub writes position + 1 there
    chunks = {r // cache.ahead.rows for r in written}
    assert len(chunks) > 3 and cache.ahead.taken == chunks
    values = cache.v[0]  # the keys store reads resident further: the stub reads whole key tiles (zero pages mapped)
    assert resident_bytes(values.data_ptr(), values.nbytes) == len(chunks) * CHUNK_BYTES
    for c in chunks:
        assert resident_bytes(values[c * cache.ahead.rows].data_ptr(), CHUNK_BYTES) == CHUNK_BYTES
    off = chats(False)
    assert resident_bytes(off.v[0].data_ptr(), off.v[0].nbytes) == 0
