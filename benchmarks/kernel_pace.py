"""A linear layer's own pace, from the cache: one matrix small enough to stay in the L3 (2,048 x 5,120 by
default: 5.9 MB in Q4_K), called again and again at a few row counts, so memory's bandwidth is out of the
measure and what is left is the kernel's work per byte. Where `benchmarks/linear_shapes.py` says how close a
step comes to the memory's pace, this says whether the arithmetic could keep up with it at all.

    OMP_NUM_THREADS=1 python benchmarks/kernel_pace.py --weights Q4_K-q8,Q6_K-q8,Q8_0-q8 --rows 1,4,8

Weights are named as in linear_shapes.py (fp32, a GGUF type name, `-q8` for gguf-q8). Each row count runs
`--rounds` rounds of `--calls` calls; the fastest round is kept. GB/s is the matrix's bytes over one call's time.
Two builds of the kernels cannot share a process (one torch namespace), so to compare two builds run this in
each, in turn, a few times. `--json FILE` writes the same. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from linear_shapes import make_linear  # this folder's, beside this script


def pace(f, rows: int, calls: int, rounds: int) -> float:
    """Seconds one call takes at `rows` rows, the fastest round's mean, after a warm-up round."""
    x = torch.randn(rows, f.in_features)
    for _ in range(calls):
        f(x)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f(x)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="Q4_K-q8,Q6_K-q8,Q8_0-q8")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--size", default="2048x5120", help="outputs x inputs")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n, _, k = a.size.partition("x")
    if not (n.isdigit() and k.isdigit()):
        raise SystemExit(f"--size {a.size!r}: give outputs x inputs, e.g. 2048x5120")
    from rich.console import Console
    from rich.table import Table

    from tfq.kernels.backend import torch_backend

    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)
    table = Table(title=f"{torch_backend().where}; {torch.get_num_threads()} threads; {n} x {k}, from the cache")
    table.add_column("weights")
    table.add_column("MB", justify="right")
    for r in rows:
        table.add_column(f"{r} rows GB/s", justify="right")
    results = []
    for weights in a.weights.split(","):
        f = make_linear(weights, int(n), int(k), rng)
        nbytes = getattr(f, "nbytes", None) or 4 * f.out_features * f.in_features
        speeds = [nbytes / pace(f, r, a.calls, a.rounds) / 1e9 for r in rows]
        results += [{"weights": weights, "rows": r, "bytes": nbytes, "gb_s": s} for r, s in zip(rows, speeds)]
        table.add_row(weights, f"{nbytes / 1e6:.1f}", *(f"{s:.1f}" for s in speeds))
    Console().print(table)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"threads": torch.get_num_threads(), "size": a.size, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
