"""The two DeltaNet arithmetics side by side on one layer of the seed's size: time and bits.

    python benchmarks/deltanet.py [--rows 512] [--repeats 3] [--json FILE]

One Gated DeltaNet layer shaped like Qwen3.5-27B's (16 key heads and 48 value heads of 128 dims, a 4-tap
convolution), random inputs at the scales a model gives. It measures, on this machine's threads:

- prefill of --rows rows: the recurrence row by row (kernels/cpu/delta.cpp, tfq's arithmetic) against the
  chunked algorithm (64-row blocks, kernels/delta.py's `deltanet_chunks`, what transformers prefills with);
- a decode row: the recurrence (one row) against the chunked algorithm's cost of a row when blocks are fixed
  to absolute positions, so a decode row recomputes the zero-padded block from the last block boundary (the
  block of 64 rows is what it runs at worst, and 32 on average);
- bits: whether each arithmetic gives a row the same bits when the prompt is cut into other prefill chunks
  (rows: by construction; chunks: the blocks move with the cut), and how far the two are apart.

docs/hybrid.md quotes the table and says why tfq runs the recurrence.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from tfq.kernels.delta import CHUNK, DeltaSizes, DeltaWeights, deltanet_chunks, deltanet_rows

SIZES = DeltaSizes(conv_kernel=4, key_heads=16, key_dim=128, value_heads=48, value_dim=128)


def inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = SIZES
    channels = 2 * n.key_heads * n.key_dim + n.value_heads * n.value_dim
    x = torch.randn(rows, channels, generator=g)
    a, b = torch.randn(rows, n.value_heads, generator=g), torch.randn(rows, n.value_heads, generator=g)
    w = DeltaWeights(conv=0.5 * torch.randn(n.conv_kernel, channels, generator=g),
                     A=-torch.rand(n.value_heads, generator=g).mul(16).add(0.01),
                     dt_bias=torch.randn(n.value_heads, generator=g), norm=torch.ones(n.value_dim))
    return x, a, b, w, channels


def states(channels: int):
    n = SIZES
    return torch.zeros(1, n.conv_kernel - 1, channels), torch.zeros(1, n.value_heads, n.key_dim, n.value_dim)


def run(kind: str, x, a, b, w, channels, cuts: list[int]) -> torch.Tensor:
    """The layer's output over all rows, the prompt fed in pieces of `cuts` rows (one state carried)."""
    conv, rec = states(channels)
    out, start = [], 0
    for count in cuts:
        rows = slice(start, start + count)
        seg = torch.tensor([[0, count, 0, int(start == 0), 0]])
        if kind == "rows":
            out.append(deltanet_rows(x[rows], a[rows], b[rows], w, conv, rec, seg, SIZES))
        else:
            out.append(deltanet_chunks(x[rows], a[rows], b[rows], w, conv, rec, seg, SIZES))
        start += count
    return torch.cat(out)


def timed(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    x, a, b, w, channels = inputs(args.rows)
    whole = [args.rows]
    odd = [61] * (args.rows // 61) + ([args.rows % 61] if args.rows % 61 else [])
    rows_whole, rows_odd = run("rows", x, a, b, w, channels, whole), run("rows", x, a, b, w, channels, odd)
    chunks_whole, chunks_odd = run("chunks", x, a, b, w, channels, whole), run("chunks", x, a, b, w, channels, odd)
    scale = rows_whole.abs().max().item()
    result = {
        "threads": torch.get_num_threads(), "rows": args.rows, "sizes": SIZES.__dict__,
        "prefill_s": {"rows": timed(lambda: run("rows", x, a, b, w, channels, whole), args.repeats),
                      "chunks": timed(lambda: run("chunks", x, a, b, w, channels, whole), args.repeats)},
        "decode_row_s": {"rows": timed(lambda: run("rows", x[:1], a[:1], b[:1], w, channels, [1]), 5 * args.repeats),
                         "chunks, a full block": timed(lambda: run("chunks", x[:CHUNK], a[:CHUNK], b[:CHUNK], w,
                                                                   channels, [CHUNK]), args.repeats)},
        "bits": {"rows: whole = cut in 61-row chunks": torch.equal(rows_whole, rows_odd),
                 "chunks: whole = cut in 61-row chunks": torch.equal(chunks_whole, chunks_odd),
                 "rows = chunks": torch.equal(rows_whole, chunks_whole),
                 "max |rows - chunks| / max |rows|": (rows_whole - chunks_whole).abs().max().item() / scale},
    }
    table = Table(title=f"one DeltaNet layer of Qwen3.5-27B's size, {result['threads']} threads")
    for col in ("", "recurrence (tfq)", "chunked (64-row blocks)", "chunked / recurrence"):
        table.add_column(col, justify="right" if col else "left")
    p, d = result["prefill_s"], result["decode_row_s"]
    table.add_row(f"prefill {args.rows} rows, ms", f"{1e3 * p['rows']:.1f}", f"{1e3 * p['chunks']:.1f}",
                  f"{p['chunks'] / p['rows']:.2f}")
    table.add_row("a decode row, ms", f"{1e3 * d['rows']:.2f}", f"{1e3 * d['chunks, a full block']:.2f} (a block)",
                  f"{d['chunks, a full block'] / d['rows']:.1f}")
    bits = result["bits"]
    table.add_row("same bits cut in 61-row chunks", str(bits["rows: whole = cut in 61-row chunks"]),
                  str(bits["chunks: whole = cut in 61-row chunks"]), "")
    Console().print(table)
    Console().print(f"rows = chunks: {bits['rows = chunks']}; max |rows - chunks| / max |rows| = "
                    f"{bits['max |rows - chunks| / max |rows|']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
