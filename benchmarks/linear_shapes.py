"""The linear layers of one decode step of the default model, alone: `--layers` layers (24 in the model) of qkv
(896 -> 1152), o (896 -> 896), gate_up (896 -> 9728) and down (4864 -> 896), then the head (896 -> 151936), on
random weights through the engine's linear layer, at a few row counts, in each arithmetic asked for.

    python benchmarks/linear_shapes.py --rows 1,4,8 --weights fp32,Q4_K,Q5_0,Q5_K,Q6_K,Q8_0,Q8_0-q8

`--shape qwen3-14b` (or another dense shape of benchmarks/write_shape.py) takes that model's widths instead: a
14B's layer reads 16 times the default's bytes, so take a few `--layers`.

`fp32` is the fp32 panels; a GGUF type name (Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, Q4_0, ...) is every matrix in that
format with random blocks (tfq.proofs.kernel_check_rowwise.random_blocks), computed by the `gguf` recipe (the
dequantized fp32 model's bits; a K format's rows of 896 inputs grow to 1,024, whole super blocks); a `-q8`
suffix computes it by `gguf-q8` (activations rounded to 8 bits). Each row count runs `--repeats` times and the
fastest is kept, split by layer, with the bytes the kernels read a step over its time, beside the machine's
bandwidth measured by the bench's probes in the same run (the highest of them: the roofline `tfq bench` uses).
`--json FILE` writes the same. Speed is measured here, never asserted in tests.

`--prefetch 384:2048,4096:8192` times each `-q8` row count once per pair of prefetch distances (bytes ahead into
L1 and into L2, kernels/cpu/quant_q8.cpp), the pairs in turn within each repeat, so they are compared side by
side on a noisy machine; the fastest of the repeats per pair, as above.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
HEAD = (151936, 896)


def widths(shape: str) -> tuple[dict[str, tuple[int, int]], tuple[int, int]]:
    """A step's layers ([out, in] by name) and head: the default model's, or a dense shape of write_shape.py's."""
    if shape == "default":
        return SHAPES, HEAD
    from write_shape import SHAPES as MODELS  # this folder's, beside this script

    if MODELS.get(shape, ("",))[0] != "qwen3":
        raise SystemExit(f"--shape {shape!r}: name default or a dense shape of write_shape.py: "
                         + ", ".join(n for n, s in MODELS.items() if s[0] == "qwen3"))
    _, _, hidden, heads, kv, dim, ffn, vocab = MODELS[shape]
    return ({"qkv": ((heads + 2 * kv) * dim, hidden), "o": (hidden, heads * dim), "gate_up": (2 * ffn, hidden),
             "down": (hidden, ffn)}, (vocab, hidden))


def make_linear(weights: str, n: int, k: int, rng: np.random.Generator):
    """One [n, k] linear layer in arithmetic `weights`, on random values."""
    from tfq.kernels.backend import torch_backend

    backend = torch_backend()
    if weights == "fp32":
        return backend.linear(torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) * 0.02))
    from tfq.kernels.quant import BLOCKS, from_blocks
    from tfq.proofs.kernel_check_rowwise import random_blocks

    kind, _, activations = weights.partition("-")
    per = BLOCKS[kind][1]
    k = -(-k // per) * per  # a K format's super blocks are 256 inputs: 896 inputs become 1,024
    step = max(1, (1 << 22) // k)  # blocks made a slice of rows at a time: bounded memory
    raw = np.concatenate([random_blocks(kind, min(step, n - r), k, rng) for r in range(0, n, step)])
    q = from_blocks(kind, raw, (n, k))
    return backend.quant_linear(q.with_activations(activations) if activations else q)


def step_bytes(layers: dict, head) -> int:
    """Bytes the kernels read a step: fp32 panels, or the blobs' integers and scales."""
    size = lambda f: getattr(f, "nbytes", None) or 4 * f.out_features * f.in_features  # noqa: E731
    return sum(size(f) for fs in layers.values() for f in fs) + size(head)


def one_pass(layers: dict, head, xs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Seconds by layer name of one pass over every layer."""
    times = {}
    for name, fs in [*layers.items(), ("head", [head])]:
        t0 = time.perf_counter()
        for f in fs:
            f(xs[name])
        times[name] = time.perf_counter() - t0
    return times


def time_rows(layers: dict, head, rows: int, repeats: int, rng: np.random.Generator,
              reaches: list[tuple[int, int] | None]) -> list[dict[str, float]]:
    """For each prefetch pair (None: the kernels' own), the fastest of `repeats` passes at `rows` rows: seconds
    by layer name. The pairs take turns within a repeat."""
    from tfq.kernels.cpu_build import op

    xs = {name: torch.from_numpy(rng.standard_normal((rows, fs[0].in_features), dtype=np.float32))
          for name, fs in [*layers.items(), ("head", [head])]}
    own = tuple(op("q8_prefetch")()) if any(reaches) else None
    best: list[dict[str, float] | None] = [None] * len(reaches)
    try:
        for _ in range(repeats):
            for i, reach in enumerate(reaches):
                if own is not None:
                    op("q8_prefetch")(*(reach or own))
                times = one_pass(layers, head, xs)
                if best[i] is None or sum(times.values()) < sum(best[i].values()):
                    best[i] = times
    finally:
        if own is not None:
            op("q8_prefetch")(*own)
    return best


def prefetch_pair(text: str) -> tuple[int, int]:
    """'L1:L2' in bytes, each 0 or more."""
    l1, sep, l2 = text.partition(":")
    if not sep or not l1.strip().isdigit() or not l2.strip().isdigit():
        raise SystemExit(f"--prefetch {text!r}: give pairs of byte counts as L1:L2, e.g. 384:2048,4096:8192")
    return int(l1), int(l2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--weights", default="fp32", help="comma-separated: fp32 or GGUF type names, -q8 for gguf-q8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--shape", default="default", help="default (the 0.5B's widths) or a dense write_shape.py shape")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefetch", default=None, help="L1:L2 byte pairs for the -q8 kernels, e.g. 384:2048,4096:8192")
    a = ap.parse_args()
    pairs = [prefetch_pair(pair) for pair in a.prefetch.split(",")] if a.prefetch else []
    shapes, head_shape = widths(a.shape)
    from tfq.bench.measure import measure_bandwidth
    from tfq.kernels.backend import torch_backend

    bandwidth = max(measure_bandwidth().values())
    print(f"{torch_backend().where}; {torch.get_num_threads()} threads; bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(the bench's best probe)")
    rng = np.random.default_rng(0)
    results = []
    for weights in a.weights.split(","):
        layers = {name: [make_linear(weights, n, k, rng) for _ in range(a.layers)] for name, (n, k) in shapes.items()}
        head = make_linear(weights, *head_shape, rng)
        nbytes = step_bytes(layers, head)
        reaches = pairs if pairs and weights.endswith("-q8") else [None]
        for rows in (int(r) for r in a.rows.split(",")):
            for reach, best in zip(reaches, time_rows(layers, head, rows, a.repeats, rng, reaches)):
                total = sum(best.values())
                results.append({"weights": weights, "rows": rows, "prefetch": reach, "ms": total * 1e3,
                                "bytes": nbytes, "gb_s": nbytes / total / 1e9,
                                "of_bandwidth": nbytes / total / bandwidth,
                                "by_layer_ms": {name: s * 1e3 for name, s in best.items()}})
                parts = "  ".join(f"{name} {s * 1e3:.1f}" for name, s in best.items())
                ahead = f" prefetch {reach[0]}:{reach[1]}" if reach else ""
                print(f"{weights:>8} {rows} rows{ahead}: {total * 1e3:6.1f} ms  {nbytes / 1e9:.2f} GB  "
                      f"{nbytes / total / 1e9:5.1f} GB/s ({nbytes / total / bandwidth:4.0%} of the probe)  {parts}",
                      flush=True)
        del layers, head
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "bandwidth": bandwidth, "layers": a.layers, "shape": a.shape,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
