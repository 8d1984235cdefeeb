"""Attention over a KV cache on the CPU, in the two arithmetics of docs/contract.md: `attend_fixed` runs tfq's
C++ kernel (kernels/cpu/attention.cpp, its recipe in docs/contract.md section 5); `attend`, described below, is
the torch path it falls back to.

`rows`: one pass over the stream's keys in KEY_TILE-row tiles, online softmax in fp32 (running max m,
sum l, accumulator), one division by l at the end. `partial`: the same tile loop restarted at every
SPLIT_ROWS-row split, splits merged in index order by log-sum-exp.

Why it is batch-invariant: every dot product runs as a `bmm` item with exactly one query row (M = 1) and
operands in one fixed layout; measured on this build, such items give the same bits whatever the number of
items, the number of keys, or whether the operand is shared (stride 0) or copied. Everything else is
elementwise or a reduction over one tile. A row at position p therefore sees the same arithmetic in a
one-row decode, a prompt chunk or a draft verify, next to any other streams. Keys past p are masked to
-inf, so they add exact zeros and a tile past p is an exact no-op (alpha = 1).

The cache is read only through `rows` indices (physical cache row of every key position), which the
cache module derives from a lane's base or a stream's page table: paged and contiguous run the same code.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from . import cpu_build
from .contract import KEY_TILE, SATURATE, SPLIT_ROWS, AttentionBatch, Chunk, DecodeGroup

NEG_INF = float("-inf")
# Decode groups of at least this many key rows (streams x padded rows) run one product per query head of a
# KV group on keys read once; smaller ones repeat keys per head and run one product (fewer calls). Both are
# the same M = 1 items, so the bits are the same (tests/test_attention.py, and the start-up guard). Measured
# on the machines tfq ran on: repeating pays only for one stream with a short context.
PER_HEAD_ROWS = 256
CHUNK_BLOCK = 64  # query rows of a prompt chunk attended at a time


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
           scale: float) -> torch.Tensor:
    """q: [N, H, D] fp32, already written to the cache (cache first). Returns [N, H, D] fp32."""
    out = torch.empty_like(q)
    if batch.decode is not None:
        d = batch.decode
        out[d.q_rows] = _decode(q[d.q_rows] * scale, k_cache, v_cache, d, batch.partial)
    for c in batch.chunks:
        rows = slice(c.q_start, c.q_start + c.count)
        out[rows] = _chunk(q[rows] * scale, k_cache, v_cache, c, batch.partial)
    return out


def attend_fixed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                 scale: float) -> torch.Tensor:
    """`attend` by tfq's C++ kernel (kernels/cpu/attention.cpp): each (query row, KV head) one fixed-order
    computation over the row's own keys, the same wherever the row comes from. q: [N, H, D] fp32."""
    table, offsets, lengths = attention_tables(batch, q.shape[0])
    return cpu_build.op("attend")(q.contiguous(), k_cache, v_cache, table, offsets, lengths, scale, KEY_TILE,
                                  SPLIT_ROWS if batch.partial else 0)


def attention_tables(batch: AttentionBatch, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key_tables, built once per forward (every layer's attention reads the same tables)."""
    return _memo(batch.memo, "tables", lambda: key_tables(batch, rows))


def key_tables(batch: AttentionBatch, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every query row's keys as (table, offsets, lengths): row n attends to the cache rows
    table[offsets[n] : offsets[n] + lengths[n]], in position order. Built in numpy: a handful of small arrays,
    each torch op of which would cost microseconds once a forward has streamed the weights through the caches."""
    d = batch.decode
    if rows == 1 and d is not None and not batch.chunks:  # one lane's decode row: its own keys, as they are
        return d.cache_rows.reshape(-1), torch.zeros(1, dtype=torch.int64), d.lengths
    parts, offsets, lengths = [], np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    start = 0
    if d is not None:
        b, lpad = d.cache_rows.shape
        parts.append(d.cache_rows.numpy().reshape(-1))
        offsets[d.q_rows.numpy()] = np.arange(b) * lpad
        lengths[d.q_rows.numpy()] = d.lengths.numpy()
        start = b * lpad
    for c in batch.chunks:
        parts.append(c.cache_rows.numpy())
        offsets[c.q_start:c.q_start + c.count] = start
        lengths[c.q_start:c.q_start + c.count] = np.arange(c.first_pos + 1, c.first_pos + c.count + 1)
        start += len(c.cache_rows)
    table = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(table)), torch.from_numpy(offsets), torch.from_numpy(lengths)


def write(cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          dtype_name: str) -> None:
    """Store k, v ([N, Hkv, D], fp32) at cache rows `rows`; narrow dtypes saturate instead of overflowing."""
    limit = SATURATE.get(dtype_name)
    if limit is not None:
        k, v = k.clamp(-limit, limit), v.clamp(-limit, limit)
    cache_k[rows] = k.to(cache_k.dtype)
    cache_v[rows] = v.to(cache_v.dtype)


def tile_count(length: int) -> int:
    return -(-length // KEY_TILE)


def _memo(memo: dict, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _gather(cache: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
    """Keys or values of `rows` [B, Lpad] as fp32 [B * Hkv * group, Lpad, D]: `group` copies of each KV
    head (one per query head sharing it), or the KV heads once with group 1.

    The one way tfq reads a cache (lanes and pages alike); the result is contiguous, the fixed operand
    layout of every product. Whole cache rows (every KV head of a position) are gathered, widened, then
    laid out head by head.
    """
    hkv, dim = cache.shape[1:]
    b, lpad = rows.shape
    kv = cache.index_select(0, rows.reshape(-1)).float().view(b, lpad, hkv, 1, dim).permute(0, 2, 3, 1, 4)
    return kv.expand(b, hkv, group, lpad, dim).reshape(b * hkv * group, lpad, dim).contiguous()


def _decode(q: torch.Tensor, k_cache, v_cache, d: DecodeGroup, partial: bool) -> torch.Tensor:
    b, h, dim = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    lpad = d.cache_rows.shape[1]
    nt = lpad // KEY_TILE
    masked = _memo(d.memo, ("mask", h),
                   lambda: torch.arange(lpad)[None, :] > (d.lengths - 1).repeat_interleave(h)[:, None])
    if b * lpad < PER_HEAD_ROWS:  # one product for every head, on keys and values repeated per query head
        k = _gather(k_cache, d.cache_rows, group)  # [B*H, Lpad, D]
        v = _gather(v_cache, d.cache_rows, group)
        s = torch.bmm(q.reshape(b * h, 1, dim), k.transpose(1, 2)).view(b * h, lpad)

        def pv(p: torch.Tensor) -> torch.Tensor:  # p [B*H, nt, T] -> [B*H, nt, D]
            return torch.bmm(p.reshape(b * h * nt, 1, KEY_TILE), v.view(b * h * nt, KEY_TILE, dim)).view(b * h, nt, dim)
    else:  # one product per head of a KV group, on keys and values read once: the same items, no copies
        k = _gather(k_cache, d.cache_rows, 1)  # [B*Hkv, Lpad, D]
        v = _gather(v_cache, d.cache_rows, 1).view(b * hkv * nt, KEY_TILE, dim)
        qg = q.view(b, hkv, group, dim)
        s = torch.empty(b, hkv, group, lpad)
        for g in range(group):
            s[:, :, g] = torch.bmm(qg[:, :, g].reshape(b * hkv, 1, dim), k.transpose(1, 2)).view(b, hkv, lpad)
        s = s.view(b * h, lpad)

        def pv(p: torch.Tensor) -> torch.Tensor:
            pg = p.view(b, hkv, group, nt, KEY_TILE)
            out = torch.empty(b, hkv, group, nt, dim)
            for g in range(group):
                out[:, :, g] = torch.bmm(pg[:, :, g].reshape(b * hkv * nt, 1, KEY_TILE), v).view(b, hkv, nt, dim)
            return out.view(b * h, nt, dim)

    s = s.masked_fill(masked, NEG_INF)
    return _softmax_pass(s.view(b * h, nt, KEY_TILE), pv, partial).view(b, h, dim)


def _chunk(q: torch.Tensor, k_cache, v_cache, c: Chunk, partial: bool) -> torch.Tensor:
    r, h, dim = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    k = _gather(k_cache, c.cache_rows[None], 1)  # [Hkv, Lpad, D]
    v = _gather(v_cache, c.cache_rows[None], 1)
    out = torch.empty(r, h, dim)
    # Blocks of rows, each over the key tiles its last row needs: the tiles a block leaves out are masked for
    # all its rows, exact no-ops, so the bits are the same, and the scores stay small for long prompts.
    for start in range(0, r, CHUNK_BLOCK):
        stop = min(r, start + CHUNK_BLOCK)
        first = c.first_pos + start
        lpad = tile_count(c.first_pos + stop) * KEY_TILE
        nt = lpad // KEY_TILE
        masked = _memo(c.memo, ("mask", start), lambda: torch.arange(lpad)[None, None, :] >
                       torch.arange(first, c.first_pos + stop)[:, None, None])  # [rows, 1, Lpad]
        rows = stop - start
        n = rows * group
        for kv in range(hkv):
            # items (row, head of this KV group): each an M = 1 product against the shared K (stride 0)
            qh = q[start:stop, kv * group:(kv + 1) * group].reshape(n, 1, dim)
            s = torch.bmm(qh, k[kv, :lpad].T.expand(n, dim, lpad)).view(rows, group, lpad)
            s = s.masked_fill(masked, NEG_INF).view(n, nt, KEY_TILE)
            vk = v[kv]

            def pv(p: torch.Tensor) -> torch.Tensor:  # p [n, nt, T] -> [n, nt, D]
                return torch.stack([
                    torch.bmm(p[:, j, None, :], vk[j * KEY_TILE:(j + 1) * KEY_TILE].expand(n, KEY_TILE, dim))[:, 0]
                    for j in range(nt)
                ], 1)

            out[start:stop, kv * group:(kv + 1) * group] = _softmax_pass(s, pv, partial).view(rows, group, dim)
    return out


def _softmax_pass(s: torch.Tensor, pv, partial: bool) -> torch.Tensor:
    """Online softmax over tiles. s: [n, nt, T] scores, -inf where masked. Returns [n, D]."""
    n, nt, _ = s.shape
    per_split = SPLIT_ROWS // KEY_TILE if partial else nt
    tile_max = s.amax(-1)  # [n, nt]
    # running max, restarted at every split; m_prev is the max before a tile (-inf at a split's start)
    pad = (-nt) % per_split
    tm = torch.cat([tile_max, tile_max.new_full((n, pad), NEG_INF)], 1).view(n, -1, per_split)
    m = tm.cummax(-1).values
    m_prev = torch.cat([m.new_full(m.shape[:2] + (1,), NEG_INF), m[..., :-1]], -1)
    m = m.reshape(n, -1)[:, :nt]
    m_prev = m_prev.reshape(n, -1)[:, :nt]
    m_safe = torch.where(m == NEG_INF, 0.0, m)  # a split with no key yet: p = 0, not NaN
    p = torch.exp(s - m_safe[..., None])
    alpha = torch.exp(m_prev - m_safe)  # 0 at a split's start, 1 for a tile that raised nothing
    # l rides along as one more column of the accumulator: one multiply-add per tile updates both
    tile = torch.cat([pv(p), p.sum(-1, keepdim=True)], -1)  # [n, nt, D + 1]
    acc = torch.zeros(n, tile.shape[-1])
    states = []
    for j in range(nt):
        acc = torch.addcmul(tile[:, j], acc, alpha[:, j, None])  # acc * alpha + this tile
        if partial and (j % per_split == per_split - 1 or j == nt - 1):
            states.append((m[:, j], acc))
    if not partial:
        return acc[:, :-1] / acc[:, -1:]
    return _merge(states)


def _merge(states: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Log-sum-exp merge of split states (m, [acc | l]), in split index order."""
    big = torch.stack([m for m, _ in states]).amax(0)
    big = torch.where(big == NEG_INF, 0.0, big)
    acc = torch.zeros_like(states[0][1])
    for m, part in states:
        acc = torch.addcmul(acc, part, torch.exp(m - big)[:, None])  # an empty split: weight exp(-inf) = 0
    return acc[:, :-1] / acc[:, -1:]
