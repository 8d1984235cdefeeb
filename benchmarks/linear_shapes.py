"""The linear layers of one decode step of the default model, alone: 24 layers of qkv (896 -> 1152), o (896 ->
896), gate_up (896 -> 9728) and down (4864 -> 896), then the head (896 -> 151936), on random weights through
the engine's linear layer, at a few row counts.

    python benchmarks/linear_shapes.py --rows 1,4,8

Each row count runs `--repeats` times; the fastest is printed, split by layer, with the weight bytes a step
streams over its time. Only the weights' shapes matter here (2.0 GB of fp32), so no model is loaded. Speed is
measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
HEAD = (151936, 896)
LAYERS = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from tfq.kernels.backend import torch_backend

    linear = torch_backend().linear
    g = torch.Generator().manual_seed(0)
    layers = {name: [linear(torch.randn(n, k, generator=g)) for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    head = linear(torch.randn(*HEAD, generator=g))
    nbytes = 4 * (LAYERS * sum(n * k for n, k in SHAPES.values()) + HEAD[0] * HEAD[1])
    print(f"{torch_backend().where}; {torch.get_num_threads()} threads; {nbytes / 1e9:.2f} GB of weights a step")
    for rows in (int(r) for r in a.rows.split(",")):
        best: dict[str, float] | None = None
        for _ in range(a.repeats):
            times = {}
            for name, (_, k) in SHAPES.items():
                x = torch.randn(rows, k, generator=g)
                t0 = time.perf_counter()
                for f in layers[name]:
                    f(x)
                times[name] = time.perf_counter() - t0
            x = torch.randn(rows, HEAD[1], generator=g)
            t0 = time.perf_counter()
            head(x)
            times["head"] = time.perf_counter() - t0
            if best is None or sum(times.values()) < sum(best.values()):
                best = times
        total = sum(best.values())
        parts = "  ".join(f"{name} {s * 1e3:.1f}" for name, s in best.items())
        print(f"{rows} rows: {total * 1e3:.1f} ms ({nbytes / total / 1e9:.1f} GB/s)  {parts}")


if __name__ == "__main__":
    main()
