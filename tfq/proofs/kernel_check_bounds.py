"""What the kernel check measures the attention kernels against: the float64 reference and the bound on
fp32 attention's distance from it, and the rounding edge values a store must round right.

The float64 reference is computed from the stored (already rounded) K/V, so the bound is the fp32
arithmetic's alone; it is derived in `attention_bound`.
"""
from __future__ import annotations

import torch

from tfq.kernels.attention import tile_count
from tfq.kernels.contract import CACHE_DTYPES as DTYPES
from tfq.kernels.contract import KEY_TILE, SATURATE, SPLIT_ROWS

U32 = 2.0 ** -24  # fp32 unit roundoff
EXP_ULPS = 4  # error of one exp (GPU ex2.approx: 2 ulp) plus the rounding of its argument's scaling


def edge_values(dtype: str, count: int, g: torch.Generator) -> torch.Tensor:
    """fp32 values that test a store's rounding: every value of the dtype (or a sample), the midpoints
    between neighbours (ties to even), values just off the midpoints, fp32 subnormals, overflow."""
    if dtype == "fp32":
        bits = torch.randint(-2**31, 2**31 - 1, (4 * count,), generator=g, dtype=torch.int64).to(torch.int32)
        v = bits.view(torch.float32)
        return v[torch.isfinite(v)][:count]
    dt = DTYPES[dtype]
    n = 256 if dt.itemsize == 1 else 65536
    bits = torch.arange(n, dtype=torch.int32)
    grid = (bits.to(torch.uint8) if n == 256 else bits.to(torch.int16)).view(dt).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted
    mids = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    near = torch.cat([mids * (1 - 2.0 ** -20), mids * (1 + 2.0 ** -20)])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 2.0 ** -126])
    limit = SATURATE.get(dtype)
    if limit is not None:
        special = torch.cat([special, torch.tensor([limit * 1.01, -limit * 1.5, 1e30, float("inf"), -float("inf")])])
    pool = torch.cat([grid, mids, near])
    pool = pool[torch.isfinite(pool) & (pool.abs() <= grid.abs().max())]  # unsaturated overflow would be inf
    pick = pool[torch.randperm(len(pool), generator=g)[:count - len(special)]]
    out = torch.cat([special, pick])
    return torch.cat([out, torch.zeros(count - len(out))])


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, partial: bool) -> torch.Tensor:
    """Bound on |fp32 attention - float64 attention| for one query row. q [Hkv, G, D], k/v [L, Hkv, D] float64.

    With u the fp32 roundoff, S = scale * max_j sum_d |q_d k_jd| and V = max |v|, to first order:
    - a score's error is at most (D + 2) u S (the scaling and a D-term dot), and the softmax average moves
      by at most 2 V per unit of score error: 2 (D + 2) u S V;
    - every weight p_j = exp(s_j - m) carries its exp error and those of the rescalings alpha after it:
      (c + 2S) u for itself and sum (c + |dm|) u over the <= nt rescalings, where sum |dm| <= 2S; with the
      acc rescale roundings that is ((c + 1) nt + c + 4S) u, moving the average by at most twice that, times V;
    - sums: a tile's T terms, then nt rescale-and-add steps, in l and in acc, and the final division:
      (2T + 4 nt + 2) u V;
    - `partial` adds the merge: one more exp per split (c + 2S + 1) u, weighted twice, and ns additions.
    """
    length, dim = k.shape[0], k.shape[-1]
    s_abs = torch.einsum("hgd,lhd->hgl", q.abs(), k.abs()).amax(-1) * scale  # [Hkv, G]
    big_v = v.abs().amax((0, 2))[:, None]  # [Hkv, 1]
    nt = tile_count(length)
    c = EXP_ULPS
    terms = 2 * (dim + 2) * s_abs + 2 * ((c + 1) * nt + c + 4 * s_abs) + (2 * KEY_TILE + 4 * nt + 2)
    if partial:
        terms = terms + 2 * (c + 2 * s_abs + 1) + 2 * (-(-length // SPLIT_ROWS))
    return (U32 * big_v * terms).reshape(-1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of one query row over all of k, v. q [Hkv, G, D] -> [H, D]."""
    s = torch.einsum("hgd,lhd->hgl", q, k) * scale
    return torch.einsum("hgl,lhd->hgd", s.softmax(-1), v).reshape(-1, q.shape[-1])
