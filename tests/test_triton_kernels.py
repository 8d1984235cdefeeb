"""The Triton kernels (on CUDA, or under TRITON_INTERPRET=1 on the CPU): right against float64 and the torch
path, and exact on their own backend (paged == contiguous, chunk row == decode row, repeatable); the store's
rounding equals torch's bit for bit."""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (read when they are decorated)
pytest.importorskip("triton")
import triton
import triton.language as tl

from tfq.kernels import triton_attention as ta
from tfq.kernels.attention import AttentionBatch, Chunk, DecodeGroup, tile_count
from tfq.kernels.attention import attend as torch_attend
from tfq.kernels.contract import CACHE_DTYPES as DTYPES
from tfq.kernels.contract import KEY_TILE, SATURATE
from tfq.proofs.case import same_bits
from tfq.proofs.kernel_check_bounds import attention_bound, edge_values, reference

DEV = torch.device("cuda" if CUDA else "cpu")
H, HKV, D = 8, 2, 64
PAGE = 64
WINDOW = 384


def torch_store(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """What KVCache.write stores on the CPU."""
    limit = SATURATE.get(dtype)
    return (x.clamp(-limit, limit) if limit else x).to(DTYPES[dtype])


@dataclass
class Stream:
    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    base: int
    pages: list[int]

    @property
    def length(self) -> int:
        return len(self.k)


class Store:
    """Streams written both into a lane and into shuffled pages of one K/V store, canaries elsewhere."""

    def __init__(self, lengths, dtype="fp32", heads=H, kv_heads=HKV, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dtype = heads, kv_heads, dtype
        need = sum(-(-n // PAGE) for n in lengths)
        self.pool_base = len(lengths) * WINDOW
        total = self.pool_base + (2 * need + 1) * PAGE
        self.k = torch.full((total, kv_heads, D), 240.0).to(DTYPES[dtype])
        self.v = torch.full((total, kv_heads, D), -208.0).to(DTYPES[dtype])
        free = list(range(1, 2 * need + 1, 2))
        random.Random(seed).shuffle(free)
        self.streams = []
        for i, n in enumerate(lengths):
            s = Stream(torch.randn(n, kv_heads, D, generator=g), torch.randn(n, kv_heads, D, generator=g),
                       torch.randn(n, heads, D, generator=g), i * WINDOW, [free.pop() for _ in range(-(-n // PAGE))])
            for kind in ("lane", "paged"):
                rows = self.rows(s, kind, n)
                self.k[rows], self.v[rows] = torch_store(s.k, dtype), torch_store(s.v, dtype)
            self.streams.append(s)

    def rows(self, s: Stream, kind: str, count: int) -> torch.Tensor:
        pos = torch.arange(count)
        if kind == "lane":
            return s.base + pos
        return self.pool_base + torch.tensor(s.pages)[pos // PAGE] * PAGE + pos % PAGE

    def table(self, s: Stream, kind: str, length: int) -> torch.Tensor:
        return self.rows(s, kind, tile_count(length) * KEY_TILE)

    def batch(self, decode, chunks, kind, partial):
        """decode: [(stream, pos)], chunks: [(stream, start, count)] -> (q, AttentionBatch)."""
        qs, group = [], None
        if decode:
            lpad = tile_count(max(p + 1 for _, p in decode)) * KEY_TILE
            table = torch.zeros(len(decode), lpad, dtype=torch.long)
            for i, (s, p) in enumerate(decode):
                t = self.table(s, kind, p + 1)
                table[i, :len(t)] = t
            qs.append(torch.stack([s.q[p] for s, p in decode]))
            group = DecodeGroup(torch.arange(len(decode)), table, torch.tensor([p + 1 for _, p in decode]))
        at, parts = len(decode), []
        for s, a, n in chunks:
            parts.append(Chunk(at, n, a, self.table(s, kind, a + n)))
            qs.append(s.q[a:a + n])
            at += n
        return torch.cat(qs), AttentionBatch(group, parts, partial)

    def triton(self, q, batch):
        return ta.attend(q.to(DEV), self.k.to(DEV), self.v.to(DEV), batch, 1 / math.sqrt(D)).cpu()

    def torch(self, q, batch):
        return torch_attend(q, self.k, self.v, batch, 1 / math.sqrt(D))

    def check_rows(self, rows, out, partial, slack=1.0):
        """Every (stream, pos) row of out within the float64 bound (computed from the stored K/V)."""
        g = self.heads // self.kv_heads
        for (s, p), o in zip(rows, out):
            k, v = s.k[:p + 1], s.v[:p + 1]
            k, v = torch_store(k, self.dtype).double(), torch_store(v, self.dtype).double()
            q = s.q[p].double().view(self.kv_heads, g, D)
            err = (o.double() - reference(q, k, v, 1 / math.sqrt(D))).abs().amax(-1)
            bound = attention_bound(q, k, v, 1 / math.sqrt(D), partial)
            assert (err <= slack * bound).all(), f"position {p}: error {err.max():.3g} > bound {bound.min():.3g}"


def rows_of(decode, chunks):
    return list(decode) + [(s, a + i) for s, a, n in chunks for i in range(n)]


@pytest.fixture(scope="module")
def store():
    return Store((1, 70, 300))


@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial"])
def test_triton_matches_torch_within_float64_bound(store, partial):
    a, b, c = store.streams
    decode = [(a, 0), (b, 69), (c, 299)]
    chunks = [(b, 0, 8), (c, 250, 12)]  # causal chunks across a tile edge and the split edge (256)
    q, batch = store.batch(decode, chunks, "paged", partial)
    tri, ref = store.triton(q, batch), store.torch(q, batch)
    rows = rows_of(decode, chunks)
    store.check_rows(rows, tri, partial)
    store.check_rows(rows, ref, partial)
    assert not same_bits(tri, torch.zeros_like(tri))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial"])
def test_paged_equals_contiguous_bits(dtype, partial):
    s = Store((70, 290), dtype=dtype, seed=1)
    a, b = s.streams
    decode, chunks = [(a, 69), (b, 289), (b, 64)], [(b, 250, 10)]
    lane = s.triton(*s.batch(decode, chunks, "lane", partial))
    paged = s.triton(*s.batch(decode, chunks, "paged", partial))
    assert same_bits(lane, paged)
    assert same_bits(lane, s.triton(*s.batch(decode, chunks, "lane", partial)))  # and repeatable
    s.check_rows(rows_of(decode, chunks), lane, partial)


@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial"])
def test_chunk_row_equals_decode_row_bits(store, partial):
    a, b, c = store.streams
    chunks = [(c, 56, 16), (c, 248, 16), (b, 60, 10)]
    whole = store.triton(*store.batch([], chunks, "paged", partial))
    # the same positions as one-row decodes, batched beside other streams at other lengths
    decode = [(s, a0 + i) for s, a0, n in chunks for i in range(n)] + [(a, 0), (c, 299)]
    alone = store.triton(*store.batch(decode, [], "lane", partial))
    assert same_bits(whole, alone[:len(whole)])
    # a chunk cut differently: every row still the same
    split = [(c, 56, 1), (c, 57, 15), (c, 248, 9), (c, 257, 7), (b, 60, 10)]
    assert same_bits(store.triton(*store.batch([], split, "lane", partial)), whole)


def test_partial_differs_from_rows(store):
    c = store.streams[2]
    decode = [(c, 299), (c, 280)]
    rows = store.triton(*store.batch(decode, [], "lane", False))
    part = store.triton(*store.batch(decode, [], "lane", True))
    assert not same_bits(rows, part)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (7, 1)])
def test_gqa_groups(heads, kv_heads):
    s = Store((40, 130), heads=heads, kv_heads=kv_heads, seed=2)
    a, b = s.streams
    decode, chunks = [(a, 39), (b, 129)], [(b, 62, 4)]
    for partial in (False, True):
        s.check_rows(rows_of(decode, chunks), s.triton(*s.batch(decode, chunks, "paged", partial)), partial)


def plan_32k_scratch():
    """(items, KV heads, splits, BLOCK_G, D) of the largest `partial` forward a 32k plan on the default model
    allows: every one of 64 lanes brings a full prefill chunk whose keys reach the window."""
    import json

    import triton

    from tfq.kernels.contract import SPLIT_ROWS
    from tfq.model.config import ModelConfig
    from tfq.model.source import SHIPPED_DEFAULT_CONFIG
    from tfq.plan import Plan

    cfg = ModelConfig.from_dict(json.loads(SHIPPED_DEFAULT_CONFIG.read_text()))
    plan = Plan(window=32768, lanes=64)
    block_g = max(16, triton.next_power_of_2(cfg.group))
    return plan.lanes * plan.prefill_chunk, cfg.num_kv_heads, -(-plan.window // SPLIT_ROWS), block_g, cfg.head_dim


def test_partial_scratch_of_a_32k_plan_is_past_int32():
    items, kv_heads, splits, block_g, dim = plan_32k_scratch()
    assert (items, kv_heads, splits, block_g, dim) == (32768, 2, 128, 16, 64)
    assert ta.scratch_elements(items, kv_heads, splits, block_g, dim) - 1 > 2**31 - 1


@triton.jit
def _scratch_offsets_kernel(out_ptr, item, kv_head, split, n_kv, max_splits, BLOCK_G: tl.constexpr,
                            D: tl.constexpr):
    """The accumulator offsets `_partial_kernel` and `_merge_kernel` use for (item, kv_head, split)."""
    slot = ta._scratch_slot(item, kv_head, split, n_kv, max_splits, BLOCK_G)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    tl.store(out_ptr + g[:, None] * D + d[None, :], slot[:, None] * D + d[None, :])


def test_partial_scratch_offsets_are_int64():
    """The last (item, KV head, split) of the 32k plan: its offsets (past 2**31) come out whole, not wrapped.
    The ids arrive as int32 scalars, as program ids do."""
    items, kv_heads, splits, block_g, dim = plan_32k_scratch()
    out = torch.zeros(block_g, dim, dtype=torch.int64, device=DEV)
    _scratch_offsets_kernel[(1,)](out, items - 1, kv_heads - 1, splits - 1, kv_heads, splits, BLOCK_G=block_g, D=dim)
    last = ta.scratch_elements(items, kv_heads, splits, block_g, dim) - 1
    want = torch.arange(last - block_g * dim + 1, last + 1, dtype=torch.int64).view(block_g, dim)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_store_rounds_like_torch(dtype):
    g = torch.Generator().manual_seed(3)
    n = 128
    x = edge_values(dtype, n * HKV * D, g).view(n, HKV, D)
    y = torch.randn(n, HKV, D, generator=g) * 300  # saturates fp8
    cache_k = torch.full((3 * n, HKV, D), 240.0).to(DTYPES[dtype]).to(DEV)
    cache_v = torch.full((3 * n, HKV, D), -208.0).to(DTYPES[dtype]).to(DEV)
    rows = torch.randperm(3 * n, generator=g)[:n]
    before_k, before_v = cache_k.clone(), cache_v.clone()
    ta.write(cache_k, cache_v, rows, x.to(DEV), y.to(DEV), dtype)
    assert same_bits(cache_k[rows.to(DEV)].cpu(), torch_store(x, dtype))
    assert same_bits(cache_v[rows.to(DEV)].cpu(), torch_store(y, dtype))
    untouched = torch.ones(3 * n, dtype=torch.bool)
    untouched[rows] = False
    assert same_bits(cache_k[untouched.to(DEV)], before_k[untouched.to(DEV)])
    assert same_bits(cache_v[untouched.to(DEV)], before_v[untouched.to(DEV)])


def test_store_reads_strided_inputs():
    """k and v as the model hands them over: views into one qkv row (row stride > Hkv * D)."""
    qkv = torch.randn(5, (H + 2 * HKV) * D)
    k = qkv[:, H * D:(H + HKV) * D].view(5, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(5, HKV, D)
    ck, cv = torch.zeros(10, HKV, D, device=DEV), torch.zeros(10, HKV, D, device=DEV)
    rows = torch.tensor([9, 0, 4, 2, 7])
    ta.write(ck, cv, rows, k.to(DEV) if CUDA else k, v.to(DEV) if CUDA else v, "fp32")
    assert same_bits(ck[rows.to(DEV)].cpu(), k.contiguous()) and same_bits(cv[rows.to(DEV)].cpu(), v.contiguous())


@pytest.mark.skipif(not CUDA, reason="the dispatch hooks act on CUDA tensors only")
def test_the_triton_backend_serves_the_cache_and_attention(store):
    """The one interface: a cache built with the Triton backend stores through the Triton kernel, and the
    backend's attend is the Triton one (bits equal to calling it directly)."""
    from tfq.engine.cache import CacheSpec, KVCache
    from tfq.kernels.backend import triton_backend
    from tfq.model.config import ModelConfig

    backend, why = triton_backend()
    assert backend is not None, why
    c = store.streams[2]
    q, batch = store.batch([(c, 299)], [(c, 250, 8)], "paged", False)
    assert same_bits(backend.attend(q.to(DEV), store.k.to(DEV), store.v.to(DEV), batch, 1 / math.sqrt(D)).cpu(),
                     store.triton(q, batch))
    cfg = ModelConfig("qwen3", 1, H * D, 1, 1, H, HKV, D, 1e6, 1e-6, 64, True, "float32")
    cache = KVCache(cfg, CacheSpec(lanes=1, window=64, dtype="fp8"), backend=backend)
    assert cache.k[0].device.type == DEV.type
    x = torch.randn(4, HKV, D) * 500
    cache.write(0, torch.arange(4), x.to(DEV), -x.to(DEV))
    assert same_bits(cache.k[0][:4].cpu(), torch_store(x, "fp8"))


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tfq.kernels import triton_attention as ta, triton_rowwise as tr

CONST = ("GROUP", "BLOCK_G", "D", "TILE", "FP8", "SPLIT", "KIND", "BLOCK", "HAS_BIAS", "BM", "BN", "BK")
INDEX = ("table_ptr", "item_row_ptr", "item_pos_ptr", "item_table_ptr", "rows_ptr")

def build(fn, cache, consts):
    store = fn is ta._store_kernel
    cached = ("ck_ptr", "cv_ptr") if store else ("k_ptr", "v_ptr")
    sig = {n: "constexpr" if n in CONST else "*i64" if n in INDEX else cache if n in cached
           else "*fp32" if n.endswith("_ptr") else "fp32" if n in ("scale", "eps") else "i32" for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(ta.LAUNCH))

attn = dict(GROUP=7, BLOCK_G=16, D=128, TILE=64)
build(ta._rows_kernel, "*bf16", dict(attn, FP8=False))
build(ta._partial_kernel, "*u8", dict(attn, FP8=True, SPLIT=4))
build(ta._merge_kernel, "*fp32", dict(attn, SPLIT=4))
build(ta._store_kernel, "*u8", dict(KIND=3, BLOCK=64, D=128))
build(ta._store_kernel, "*u16", dict(KIND=1, BLOCK=64, D=128))
build(tr._linear_kernel, "*fp32", dict(HAS_BIAS=True, BM=16, BN=tr.BLOCK_N, BK=tr.BLOCK_K))
build(tr._rms_norm_kernel, "*fp32", dict(BLOCK=1024))
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_a_gpu():
    """Without a GPU the tests run the interpreter, which skips Triton's compiler; compile for sm_90 (PTX and
    cubin through the bundled ptxas) so a kernel that cannot be built for a GPU fails here."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("this Triton has no bundled ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-2000:]
