"""A mixture's experts read from three kinds of memory, in one process, in turn: the Qwen3-30B-A3B's one-lane
step of experts (`--layers` layers of `--experts` chosen experts each; a gate_up of 2 x 768 outputs in Q4_K and a
down in Q6_K at 2,048 inputs, 8-bit activations, `gguf-q8`) through the engine's mixture op, on blobs that are

- `own`: each in a tensor of its own (4 KiB pages: what tfq did before kernels/cpu/memory.h's lasting_memory),
- `shared`: carved one after another from shared blocks of 4 KiB pages,
- `huge`: carved from shared blocks of 2 MiB pages (what lasting_memory does now).

    python benchmarks/expert_memory.py --rounds 6 --json out.json

Each round times 20 steps of each kind, the kinds in a rotating order; the median step a kind a round, with the
bytes the experts read over it. The same blobs' bits everywhere: the outputs are compared before timing.
"""
from __future__ import annotations

import argparse
import json
import mmap
import time

import numpy as np
import torch

from tfq.kernels.moe import expert_bank, mixture_fixed
from tfq.kernels.quant import QuantLinear, from_blocks, join
from tfq.proofs.kernel_check_rowwise import random_blocks

HIDDEN, INTER, HUGE, BLOCK = 2048, 768, 2 << 20, 32 << 20
KINDS = ("own", "shared", "huge")


class Blocks:
    """Bump allocation from blocks of private anonymous memory, 64-byte aligned, with 2 MiB pages or without."""

    def __init__(self, huge: bool):
        self.huge, self.maps, self.left = huge, [], 0

    def take(self, n: int) -> torch.Tensor:
        step = -(-n // 64) * 64
        if step > self.left:
            m = mmap.mmap(-1, BLOCK + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE if self.huge else mmap.MADV_NOHUGEPAGE)
            self.maps.append(m)
            whole = torch.frombuffer(m, dtype=torch.uint8)
            start = -whole.data_ptr() % HUGE
            self.block, self.at, self.left = whole[start:start + BLOCK], 0, BLOCK
        out = self.block[self.at:self.at + n]
        self.at, self.left = self.at + step, self.left - step
        return out


def banks(kind: str, blobs: tuple[torch.Tensor, torch.Tensor], layers: int, experts: int) -> list:
    home = Blocks(kind == "huge")
    out = []
    for _ in range(layers):
        held = [[], []]
        for _ in range(experts):
            for blob, into in zip(blobs, held):
                t = torch.empty(blob.numel(), dtype=torch.uint8) if kind == "own" else home.take(blob.numel())
                into.append(t.copy_(blob))
        out.append((expert_bank(*held), held, home))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q = lambda kind, n, k: from_blocks(kind, random_blocks(kind, n, k, rng), (n, k)).with_activations("q8")  # noqa: E731
    blobs = (QuantLinear(join([q("Q4_K", INTER, HIDDEN), q("Q4_K", INTER, HIDDEN)])).panels,
             QuantLinear(q("Q6_K", HIDDEN, INTER)).panels)
    every = {kind: banks(kind, blobs, a.layers, a.experts) for kind in KINDS}
    h, ids = torch.randn(1, HIDDEN), torch.arange(a.experts).view(1, -1)
    w = torch.full((1, a.experts), 1.0 / a.experts)
    step = lambda kind: [mixture_fixed(h, ids, w, bank, INTER) for bank, _, _ in every[kind]]  # noqa: E731
    first = step("own")
    assert all(all(torch.equal(x, y) for x, y in zip(first, step(kind))) for kind in KINDS)
    nbytes = a.layers * a.experts * sum(b.numel() for b in blobs)
    rows = []
    for r in range(a.rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            times = []
            for _ in range(20):
                t = time.perf_counter()
                step(kind)
                times.append(time.perf_counter() - t)
            ms = 1e3 * float(np.median(times))
            rows.append({"round": r, "memory": kind, "ms": ms, "GB/s": nbytes / ms / 1e6})
            print(f"round {r}  {kind:6s}  {ms:6.2f} ms  {nbytes / ms / 1e6:5.1f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
