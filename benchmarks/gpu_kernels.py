"""Time tfq's Triton attention against torch SDPA on a GPU: decode (one query row per stream) and a prompt
chunk, at 1, 8 and 32 streams of 1k, 8k and 32k cached rows. Then tfq's batch-invariant Triton linear
layer against cuBLAS (F.linear in fp32 and bf16) on the default model's shapes, with whether each gives a
row the same bits at every batch size.

    python benchmarks/gpu_kernels.py [--heads 14 --kv-heads 2 --head-dim 64 --chunk 128 --dtype fp32]

tfq reads a paged cache (shuffled 64-row pages) in fp32 arithmetic with a batch-invariant tile order;
the baselines are SDPA on contiguous per-stream K/V (GQA expanded), in fp32 and in bf16 (flash backend),
i.e. what a throughput-first engine would run. Prints one row per shape, times in milliseconds.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

STREAMS = (1, 8, 32)
ROWS = (1024, 8192, 32768)


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench_shape(b: int, n: int, a: argparse.Namespace, g: torch.Generator) -> None:
    """One row of the table: b streams of n cached rows each."""
    from tfq.kernels.attention import AttentionBatch, Chunk, DecodeGroup
    from tfq.kernels.contract import CACHE_DTYPES as DTYPES
    from tfq.kernels.contract import KEY_TILE
    from tfq.kernels.triton_attention import attend, write

    dev, h, hkv, d = torch.device("cuda"), a.heads, a.kv_heads, a.head_dim
    scale = 1 / math.sqrt(d)
    pages = b * n // KEY_TILE
    cache_k = torch.empty(pages * KEY_TILE, hkv, d, device=dev, dtype=DTYPES[a.dtype])
    cache_v = torch.empty_like(cache_k)
    kk = torch.randn(b, n, hkv, d, device=dev, generator=g)
    vv = torch.randn(b, n, hkv, d, device=dev, generator=g)
    order = torch.randperm(pages, device=dev, generator=g).view(b, n // KEY_TILE)
    table = (order[:, :, None] * KEY_TILE + torch.arange(KEY_TILE, device=dev)).reshape(b, n)
    write(cache_k, cache_v, table.reshape(-1), kk.reshape(-1, hkv, d), vv.reshape(-1, hkv, d), a.dtype)
    stored_k = cache_k[table].float()  # [b, n, hkv, d]: what tfq reads, for the baselines
    stored_v = cache_v[table].float()
    k32 = stored_k.permute(0, 2, 1, 3).repeat_interleave(h // hkv, 1)  # [b, h, n, d]
    v32 = stored_v.permute(0, 2, 1, 3).repeat_interleave(h // hkv, 1)
    k16, v16 = k32.bfloat16(), v32.bfloat16()

    q = torch.randn(b, h, d, device=dev, generator=g)
    dec = {p: AttentionBatch(DecodeGroup(torch.arange(b, device=dev), table, torch.full((b,), n, device=dev)),
                             [], p) for p in (False, True)}
    out = attend(q, cache_k, cache_v, dec[False], scale)
    ref = F.scaled_dot_product_attention(q[:, :, None], k32, v32, scale=scale)[:, :, 0]
    decode = [timed(lambda p=p: attend(q, cache_k, cache_v, dec[p], scale)) for p in (False, True)]
    decode += [timed(lambda: F.scaled_dot_product_attention(q[:, :, None], k32, v32, scale=scale)),
               timed(lambda: F.scaled_dot_product_attention(q[:, :, None].bfloat16(), k16, v16, scale=scale))]

    r = min(a.chunk, n)
    qc = torch.randn(b * r, h, d, device=dev, generator=g)
    chunks = [Chunk(i * r, r, n - r, table[i]) for i in range(b)]
    chk = {p: AttentionBatch(None, chunks, p) for p in (False, True)}
    mask = torch.arange(n, device=dev)[None, :] <= torch.arange(n - r, n, device=dev)[:, None]
    qs = qc.view(b, r, h, d).transpose(1, 2)
    chunk = [timed(lambda p=p: attend(qc, cache_k, cache_v, chk[p], scale)) for p in (False, True)]
    chunk += [timed(lambda: F.scaled_dot_product_attention(qs, k32, v32, attn_mask=mask, scale=scale)),
              timed(lambda: F.scaled_dot_product_attention(qs.bfloat16(), k16, v16, attn_mask=mask,
                                                           scale=scale))]
    new_k = torch.randn(b, hkv, d, device=dev, generator=g)
    store = timed(lambda: write(cache_k, cache_v, table[:, -1], new_k, new_k, a.dtype))
    print(f"{b:>7} {n:>6} | {decode[0]:>11.3f} {decode[1]:>8.3f} {decode[2]:>7.3f} {decode[3]:>7.3f} | "
          f"{chunk[0]:>10.3f} {chunk[1]:>8.3f} {chunk[2]:>7.3f} {chunk[3]:>7.3f} | {store:>6.3f} | "
          f"{(out - ref).abs().max().item():.2e}", flush=True)


LINEAR_SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
                 "lm_head": (896, 151936)}
LINEAR_ROWS = (1, 8, 32, 512)


def bench_linear(g: torch.Generator) -> None:
    from tfq.kernels.triton_rowwise import TritonLinear

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    print(f"\n{'layer':>8} {'rows':>5} | {'tfq':>8} {'cublas32':>8} {'cublas16':>8} (ms) | rows equal across batch "
          f"sizes: tfq, cublas32")
    for name, (n_in, n_out) in LINEAR_SHAPES.items():
        w = torch.randn(n_out, n_in, device=dev, generator=g) / n_in ** 0.5
        f, w16 = TritonLinear(w, None, dev), w.bfloat16()
        x = torch.randn(max(LINEAR_ROWS), n_in, device=dev, generator=g)
        full_tfq, full_cublas = f(x), F.linear(x, w)
        for m in LINEAR_ROWS:
            xm = x[:m]
            same = (torch.equal(f(xm), full_tfq[:m]), torch.equal(F.linear(xm, w), full_cublas[:m]))
            times = (timed(lambda: f(xm)), timed(lambda: F.linear(xm, w)), timed(lambda: F.linear(xm.bfloat16(), w16)))
            print(f"{name:>8} {m:>5} | {times[0]:>8.3f} {times[1]:>8.3f} {times[2]:>8.3f}      | "
                  f"{'yes' if same[0] else 'NO'}, {'yes' if same[1] else 'no'}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels: no CUDA device on this machine; GPU timings need one (the CPU runs `tfq kernels`)")
    from tfq.kernels.contract import CACHE_DTYPES as DTYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=128, help="query rows of the prompt-chunk case (per stream)")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="cache dtype tfq reads")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  heads {a.heads}/{a.kv_heads}  head_dim {a.head_dim}  "
          f"cache {a.dtype}  (ms per call)")
    print(f"{'streams':>7} {'rows':>6} | {'decode rows':>11} {'partial':>8} {'sdpa32':>7} {'sdpa16':>7} | "
          f"{'chunk rows':>10} {'partial':>8} {'sdpa32':>7} {'sdpa16':>7} | {'store':>6} | max|tfq-sdpa32|")
    for b in STREAMS:
        for n in ROWS:
            bench_shape(b, n, a, g)
            torch.cuda.empty_cache()
    bench_linear(g)


if __name__ == "__main__":
    main()
