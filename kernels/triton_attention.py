"""Attention and cache stores in Triton (the GPU path; the CPU runs them under TRITON_INTERPRET=1).

Same two arithmetics and the same interface as kernels/attention.py (docs/contract.md):
- `rows`: one program per (query row, KV head) runs one pass over KEY_TILE-row key tiles with an online
  softmax in fp32 and divides by l once at the end. The program holds every query head of its KV head (GQA).
- `partial`: one program per (query row, KV head, split) runs the same tile loop over its SPLIT_ROWS keys
  from a fresh state into (m, l, acc); `merge` combines the splits in index order by log-sum-exp.

Why a row's bits do not depend on the batch: every query row is its own program, whatever brought it (a
decode group, a prompt chunk, a draft verify), and loops over exactly tile_count(position + 1) tiles of
its stream, so a chunk row at position p runs the instructions a one-row decode at p runs. Keys are read
through the row table (the physical cache row of every key position), so a lane and a page list are the
same code; a masked key is never loaded and scores -inf (an exact zero).

`write` stores new keys/values in the cache dtype with integer bit operations (round to nearest even,
fp8 clamped to +-448, fp16 to +-65504), so the bits are right both on a GPU and in the interpreter (whose
float casts truncate and do not saturate); they equal torch's `clamp(...).to(dtype)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import KEY_TILE, SPLIT_ROWS, AttentionBatch

SPLIT_TILES = SPLIT_ROWS // KEY_TILE
STORE_KIND = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3}
_BITS_VIEW = {"fp32": torch.float32, "bf16": torch.uint16, "fp16": torch.uint16, "fp8": torch.uint8}
# Every multiply and add rounds on its own (no fused multiply-add): the bits then follow the source, and do
# not change with Triton's default (fusion on up to 3.9, off from 3.10).
LAUNCH = dict(enable_fp_fusion=False)


# ---------------------------------------------------------------------------------------------- attention

@triton.jit
def _widen(x, FP8: tl.constexpr):
    """A cache element -> fp32 (exact). fp8 e4m3fn arrives as its uint8 bits (GPUs before sm_89 cannot load
    fp8): sign, 4-bit exponent (bias 7), 3-bit mantissa; exponent 0 is subnormal (m * 2^-9), 0x7F is NaN."""
    if FP8:
        b = x.to(tl.uint32)
        e = (b >> 3) & 0xF
        m = b & 0x7
        sign = (b & 0x80) << 24
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = (sign | 0x3F800000).to(tl.float32, bitcast=True) * m.to(tl.float32) * 0.001953125
        y = tl.where(e == 0, sub, normal)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), y)
    else:
        return x.to(tl.float32)


@triton.jit
def _tile_loop(q, q_pos, table, k_ptr, v_ptr, kv_head, stride_kr, stride_kh, stride_vr, stride_vh,
               t_begin, t_end, m, l, acc, TILE: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    """Online softmax over key tiles [t_begin, t_end) of one stream; the one loop `rows` and `partial` share."""
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, D)
    for t in range(t_begin, t_end):
        pos = t * TILE + offs_t
        live = pos <= q_pos
        rows = tl.load(table + pos, mask=live, other=0).to(tl.int64)
        k = _widen(tl.load(k_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + offs_d[None, :],
                           mask=live[:, None], other=0), FP8)
        v = _widen(tl.load(v_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + offs_d[None, :],
                           mask=live[:, None], other=0), FP8)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G, TILE]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)  # 0 on a fresh state (m = -inf)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    return m, l, acc


@triton.jit
def _load_query(q_ptr, q_row, kv_head, stride_qn, stride_qh, scale, GROUP: tl.constexpr,
                BLOCK_G: tl.constexpr, D: tl.constexpr):
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    ptr = q_ptr + q_row * stride_qn + (kv_head * GROUP + g[:, None]) * stride_qh + d[None, :]
    return tl.load(ptr, mask=g[:, None] < GROUP, other=0.0) * scale


@triton.jit
def _rows_kernel(q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, item_row_ptr, item_pos_ptr, item_table_ptr, scale,
                 stride_qn, stride_qh, stride_on, stride_oh, stride_kr, stride_kh, stride_vr, stride_vh,
                 GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                 FP8: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_row = tl.load(item_row_ptr + item)
    q_pos = tl.load(item_pos_ptr + item).to(tl.int32)
    table = table_ptr + tl.load(item_table_ptr + item)
    q = _load_query(q_ptr, q_row, kv_head, stride_qn, stride_qh, scale, GROUP, BLOCK_G, D)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    n_tiles = q_pos // TILE + 1
    m, l, acc = _tile_loop(q, q_pos, table, k_ptr, v_ptr, kv_head, stride_kr, stride_kh, stride_vr, stride_vh,
                           0, n_tiles, m, l, acc, TILE, D, FP8)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    ptr = out_ptr + q_row * stride_on + (kv_head * GROUP + g[:, None]) * stride_oh + d[None, :]
    tl.store(ptr, acc / l[:, None], mask=g[:, None] < GROUP)


def scratch_elements(items: int, kv_heads: int, max_splits: int, block_g: int, dim: int) -> int:
    """fp32 elements of the `partial` accumulator scratch: a [BLOCK_G, D] block per (item, KV head, split).
    A 32k window with many streams takes past 2**31 of them (lanes 64 x prefill_chunk 512 items x 2 KV heads x
    128 splits x 16 x 64 = 2**33), so the kernels index the scratch in int64 (`_scratch_slot`)."""
    return items * kv_heads * max_splits * block_g * dim


@triton.jit
def _scratch_slot(item, kv_head, split, n_kv, max_splits, BLOCK_G: tl.constexpr):
    """The BLOCK_G slots (int64) of (item, KV head, split) in the m and l scratch; the accumulator's rows are
    slot * D + d. Program ids and sizes arrive as int32: widen before multiplying so nothing wraps."""
    base = (item.to(tl.int64) * n_kv + kv_head) * max_splits + split
    return base * BLOCK_G + tl.arange(0, BLOCK_G)


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, item_row_ptr, item_pos_ptr, item_table_ptr, scale,
                    m_ptr, l_ptr, acc_ptr, n_kv, max_splits,
                    stride_qn, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                    FP8: tl.constexpr, SPLIT: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(item_row_ptr + item)
    q_pos = tl.load(item_pos_ptr + item).to(tl.int32)
    table = table_ptr + tl.load(item_table_ptr + item)
    q = _load_query(q_ptr, q_row, kv_head, stride_qn, stride_qh, scale, GROUP, BLOCK_G, D)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    n_tiles = q_pos // TILE + 1
    t_begin = split * SPLIT
    t_end = tl.minimum(t_begin + SPLIT, n_tiles)  # a split past the row's keys loops nothing (merge skips it)
    m, l, acc = _tile_loop(q, q_pos, table, k_ptr, v_ptr, kv_head, stride_kr, stride_kh, stride_vr, stride_vh,
                           t_begin, t_end, m, l, acc, TILE, D, FP8)
    d = tl.arange(0, D)
    slot = _scratch_slot(item, kv_head, split, n_kv, max_splits, BLOCK_G)
    tl.store(m_ptr + slot, m)
    tl.store(l_ptr + slot, l)
    tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc)


@triton.jit
def _merge_kernel(out_ptr, item_row_ptr, item_pos_ptr, m_ptr, l_ptr, acc_ptr, n_kv, max_splits,
                  stride_on, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                  TILE: tl.constexpr, SPLIT: tl.constexpr):
    """Log-sum-exp merge of one row's splits, in split index order."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_row = tl.load(item_row_ptr + item)
    q_pos = tl.load(item_pos_ptr + item).to(tl.int32)
    n_splits = (q_pos // TILE) // SPLIT + 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    big = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for s in range(0, n_splits):
        big = tl.maximum(big, tl.load(m_ptr + _scratch_slot(item, kv_head, s, n_kv, max_splits, BLOCK_G)))
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for s in range(0, n_splits):
        slot = _scratch_slot(item, kv_head, s, n_kv, max_splits, BLOCK_G)
        w = tl.exp(tl.load(m_ptr + slot) - big)
        l = l + tl.load(l_ptr + slot) * w
        acc = acc + tl.load(acc_ptr + slot[:, None] * D + d[None, :]) * w[:, None]
    ptr = out_ptr + q_row * stride_on + (kv_head * GROUP + g[:, None]) * stride_oh + d[None, :]
    tl.store(ptr, acc / l[:, None], mask=g[:, None] < GROUP)


def _items(batch: AttentionBatch, device: torch.device):
    """Flatten the batch into work items (query row, position, offset of its row table) and one row table."""
    rows, pos, offs, tables = [], [], [], []
    offset, max_keys = 0, 0
    d = batch.decode
    if d is not None and len(d.q_rows):
        b, lpad = d.cache_rows.shape
        rows.append(d.q_rows.to(device))
        pos.append(d.lengths.to(device) - 1)
        offs.append(torch.arange(b, device=device) * lpad)
        tables.append(d.cache_rows.reshape(-1).to(device))
        offset, max_keys = b * lpad, lpad
    for c in batch.chunks:
        rows.append(torch.arange(c.q_start, c.q_start + c.count, device=device))
        pos.append(torch.arange(c.first_pos, c.first_pos + c.count, device=device))
        offs.append(torch.full((c.count,), offset, device=device))
        tables.append(c.cache_rows.to(device))
        offset += len(c.cache_rows)
        max_keys = max(max_keys, len(c.cache_rows))
    if not rows:
        return None
    cat = lambda parts: torch.cat(parts).to(torch.int64).contiguous()  # noqa: E731
    return cat(rows), cat(pos), cat(offs), cat(tables), max_keys


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
           scale: float) -> torch.Tensor:
    """q: [N, H, D] fp32, already written to the cache (cache first). Returns [N, H, D] fp32."""
    n, h, dim = q.shape
    hkv = k_cache.shape[1]
    if h % hkv or dim & (dim - 1) or q.dtype != torch.float32:
        raise ValueError(f"attention needs fp32 q with heads ({h}) a multiple of KV heads ({hkv}) and a "
                         f"power-of-two head size ({dim})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the K/V cache's last dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    items = _items(batch, q.device)
    if items is None:
        return out
    item_row, item_pos, item_table, table, max_keys = items
    group = h // hkv
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    common = dict(GROUP=group, BLOCK_G=block_g, D=dim, TILE=KEY_TILE, **LAUNCH)
    strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    n_items = len(item_row)
    if not batch.partial:
        _rows_kernel[(n_items, hkv)](q, out, k_cache, v_cache, table, item_row, item_pos, item_table, scale,
                                     q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, FP8=fp8,
                                     **common)
        return out
    max_splits = -(-max_keys // SPLIT_ROWS)
    m = torch.empty(scratch_elements(n_items, hkv, max_splits, block_g, 1), device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(scratch_elements(n_items, hkv, max_splits, block_g, dim), device=q.device)
    _partial_kernel[(n_items, hkv, max_splits)](q, k_cache, v_cache, table, item_row, item_pos, item_table, scale,
                                                m, l, acc, hkv, max_splits, q.stride(0), q.stride(1), *strides,
                                                FP8=fp8, SPLIT=SPLIT_TILES, **common)
    _merge_kernel[(n_items, hkv)](out, item_row, item_pos, m, l, acc, hkv, max_splits, out.stride(0),
                                  out.stride(1), SPLIT=SPLIT_TILES, **common)
    return out


# ---------------------------------------------------------------------------------------------- store

@triton.jit
def _narrow_bits(x, M: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, NAN: tl.constexpr,
                 SIGN_SHIFT: tl.constexpr):
    """fp32 -> bits of a float with M mantissa bits and exponent bias BIAS: saturate at MAX_BITS (the fp32
    bits of the largest finite value), round to nearest even, subnormals included. Integer ops only."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits & 0x80000000) >> SIGN_SHIFT
    a = bits & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.minimum(a, MAX_BITS)
    e32 = (a >> 23).to(tl.int32)
    odd = (a >> (23 - M)) & 1
    normal = ((a + ((1 << (22 - M)) - 1) + odd) >> (23 - M)) - ((127 - BIAS) << M)
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(151 - BIAS - M - e32, 1), 31).to(tl.uint32)
    one = tl.full(sh.shape, 1, tl.uint32)
    quot = mant >> sh
    rem = mant & ((one << sh) - 1)
    half = one << (sh - 1)
    up = (rem > half) | ((rem == half) & ((quot & 1) == 1))
    sub = quot + up.to(tl.uint32)
    r = tl.where(e32 >= 128 - BIAS, normal, sub)
    return tl.where(nan, NAN, r) | sign


@triton.jit
def _encode(x, KIND: tl.constexpr):
    if KIND == 0:
        return x
    elif KIND == 1:  # bf16: no saturation (same range as fp32); torch writes NaN as 0x7FC0
        a = x.to(tl.uint32, bitcast=True)
        r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
        return tl.where((a & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r).to(tl.uint16)
    elif KIND == 2:  # fp16: 5-bit exponent, 10-bit mantissa, +-65504
        return _narrow_bits(x, 10, 15, 0x477FE000, 0x7E00, 16).to(tl.uint16)
    else:  # fp8 e4m3fn: 4-bit exponent, 3-bit mantissa, +-448
        return _narrow_bits(x, 3, 7, 0x43E00000, 0x7F, 24).to(tl.uint8)


@triton.jit
def _store_kernel(ck_ptr, cv_ptr, rows_ptr, k_ptr, v_ptr, n_slots, n_kv, stride_cr, stride_ch, stride_kn, stride_kh,
                  stride_vn, stride_vh, KIND: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    """One program stores BLOCK (row, KV head) slots of the flattened [N * Hkv] new keys and values."""
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = (slot < n_slots)[:, None]
    i = (slot // n_kv)[:, None]
    hh = (slot % n_kv)[:, None]
    d = tl.arange(0, D)[None, :]
    row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
    dst = row * stride_cr + hh * stride_ch + d
    k = tl.load(k_ptr + i * stride_kn + hh * stride_kh + d, mask=ok, other=0.0)
    v = tl.load(v_ptr + i * stride_vn + hh * stride_vh + d, mask=ok, other=0.0)
    tl.store(ck_ptr + dst, _encode(k, KIND), mask=ok)
    tl.store(cv_ptr + dst, _encode(v, KIND), mask=ok)


# (row, KV head) slots per program; the interpreter pays per program, not per element, so it takes more
STORE_BLOCK = 512 if type(_store_kernel).__name__ == "InterpretedFunction" else 64


def write(cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          dtype_name: str) -> None:
    """Store k, v ([N, Hkv, D], fp32) at cache rows `rows` ([N]) of a [rows_total, Hkv, D] cache pair."""
    n, hkv, dim = k.shape
    if n == 0:
        return
    if cache_k.shape != cache_v.shape or cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("K and V caches must have one shape and layout, contiguous in the last dimension")
    if dim & (dim - 1) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"write needs a power-of-two head size ({dim}) contiguous in memory")
    view = _BITS_VIEW[dtype_name]
    ck, cv = cache_k.view(view), cache_v.view(view)
    k, v = k.float(), v.float()
    slots = n * hkv
    _store_kernel[(triton.cdiv(slots, STORE_BLOCK),)](
        ck, cv, rows.to(cache_k.device).to(torch.int64).contiguous(), k, v, slots, hkv,
        ck.stride(0), ck.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KIND=STORE_KIND[dtype_name], BLOCK=STORE_BLOCK, D=dim, **LAUNCH)
