"""The CPU attention kernels, tfq's C++ one (`attend_fixed`, the default) and the bmm one (`attend`, torch's):
right (against float64) and batch-invariant (bits)."""
import math

import pytest
import torch

from tfq.kernels.attention import AttentionBatch, Chunk, DecodeGroup, attend, attend_fixed, tile_count
from tfq.kernels.contract import KEY_TILE

H, HKV, D = 8, 2, 64


def reference(q, k, v, first_pos):
    """float64 causal attention of rows at first_pos.. over keys 0..L-1 ([L, Hkv, D])."""
    r = q.shape[0]
    g = H // HKV
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)  # [H, L, D]
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    s = torch.einsum("rhd,hld->hrl", q.double(), kk) / math.sqrt(D)
    pos = torch.arange(first_pos, first_pos + r)
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hrl,hld->rhd", s.softmax(-1), vv)


def rows_for(base, length):
    return torch.arange(base, base + tile_count(length) * KEY_TILE)


def run_chunk(q, cache_k, cache_v, base, first_pos, partial=False, fn=attend):
    r = q.shape[0]
    c = Chunk(0, r, first_pos, rows_for(base, first_pos + r))
    return fn(q, cache_k, cache_v, AttentionBatch(None, [c], partial), 1 / math.sqrt(D))


def run_decode(qs, cache_k, cache_v, bases, lengths, partial=False, fn=attend):
    lpad = tile_count(max(lengths)) * KEY_TILE
    rows = torch.stack([torch.arange(b, b + lpad) for b in bases])
    d = DecodeGroup(torch.arange(len(qs)), rows, torch.tensor(lengths))
    return fn(torch.stack(qs), cache_k, cache_v, AttentionBatch(d, [], partial), 1 / math.sqrt(D))


@pytest.fixture(params=[attend_fixed, attend], ids=["fixed", "bmm"])
def fn(request):
    return request.param


@pytest.fixture
def cache():
    g = torch.Generator().manual_seed(0)
    rows = 4 * 1024
    return torch.randn(rows, HKV, D, generator=g), torch.randn(rows, HKV, D, generator=g), g


@pytest.mark.parametrize("partial", [False, True])
def test_matches_float64(cache, partial, fn):
    k, v, g = cache
    q = torch.randn(300, H, D, generator=g)
    out = run_chunk(q, k, v, base=0, first_pos=0, partial=partial, fn=fn)
    ref = reference(q, k[:300], v[:300], 0)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("partial", [False, True])
def test_rows_equal_in_chunk_decode_and_batch(cache, partial, fn):
    k, v, g = cache
    length = 333
    q = torch.randn(length, H, D, generator=g)
    whole = run_chunk(q, k, v, 0, 0, partial, fn)
    # chunks of uneven sizes
    start, parts = 0, []
    for size in (1, 63, 64, 100, 105):
        parts.append(run_chunk(q[start:start + size], k, v, 0, start, partial, fn))
        start += size
    assert torch.equal(torch.cat(parts), whole)
    # each row as a lone decode, and batched beside streams of other lengths (other lanes of the cache)
    other = torch.randn(H, D, generator=g)
    for pos in (0, 1, 63, 64, 200, 332):
        alone = run_decode([q[pos]], k, v, [0], [pos + 1], partial, fn)
        assert torch.equal(alone[0], whole[pos])
        batched = run_decode([other, q[pos], other], k, v, [1024, 0, 2048], [700, pos + 1, 5], partial, fn)
        assert torch.equal(batched[1], whole[pos])


def test_partial_differs_from_rows(cache, fn):
    k, v, g = cache
    q = torch.randn(600, H, D, generator=g)
    assert not torch.equal(run_chunk(q, k, v, 0, 0, False, fn=fn), run_chunk(q, k, v, 0, 0, True, fn=fn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("partial", [False, True])
def test_the_fixed_kernel_is_the_same_at_any_thread_count_and_cache_dtype(cache, dtype, partial):
    """Each (row, KV head) is one thread's fixed-order work: the thread count cannot matter, and a decode row
    equals the same row of a prompt chunk in every cache dtype."""
    k, v, g = cache
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(300, H, D, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 7, 16):
            torch.set_num_threads(n)
            outs.append(run_chunk(q, k, v, 0, 0, partial, attend_fixed))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for pos in (0, 64, 299):
        assert torch.equal(run_decode([q[pos]], k, v, [0], [pos + 1], partial, attend_fixed)[0], outs[0][pos])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("partial", [False, True])
def test_both_decode_layouts_give_the_same_bits(cache, dtype, partial, monkeypatch):
    """Small decode groups repeat keys per query head, large ones loop over the heads: the same items."""
    import tfq.kernels.attention as attention

    k, v, g = cache
    k, v = k.to(dtype), v.to(dtype)
    qs = [torch.randn(H, D, generator=g) for _ in range(3)]
    lengths = [700, 1, 300]
    out = {}
    for name, rows in (("repeat", 1 << 62), ("per head", 0)):
        monkeypatch.setattr(attention, "PER_HEAD_ROWS", rows)
        out[name] = run_decode(qs, k, v, [1024, 0, 2048], lengths, partial)
    assert torch.equal(out["repeat"], out["per head"])
    monkeypatch.setattr(attention, "PER_HEAD_ROWS", 1 << 62)
    assert torch.equal(run_decode([qs[2]], k, v, [2048], [300], partial)[0], out["per head"][2])
