"""The kernel check: paged == contiguous in bits, within a float64 bound, repeatable, guarded, with controls.

For every backend (torch; Triton on a GPU or under the interpreter), cache dtype and attention kernel
(`rows`, `partial`) it runs a few streams of ragged lengths through one KVCache twice: once in contiguous
lanes, once in shuffled pages, and checks
- stores:  the cache contents after the writes (prompt chunk, middle chunk, single-row decodes) are equal
           in bits in the lane and in the pages, and within the dtype's rounding of the written values;
- keep:    rows written earlier are unchanged by later writes, of the same or other streams;
- queries: a one-row decode group (ragged lengths) reads the same bits through the pages as through the
           lanes, within a float64 bound;
- rows:    multi-row causal chunks beside a decode group, likewise, and each chunk row equal in bits to
           the one-row decode at its position.
Each runs `repeats` times (identical bits every time). Every row of the store that belongs to no stream
(a guard lane between lanes, a guard page between pages, the tail of a lane or a last page) holds a
canary, checked untouched after every kernel call. Controls prove each check can fail: they must be RED.

The parts: the settings (kernel_check_config), the attention bench over one KVCache (kernel_check_attention),
the float64 reference, bounds and edge values (kernel_check_bounds), the linear layers and RMS norm
(kernel_check_rowwise).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from tfq.kernels.backend import Backend
from tfq.proofs.case import Case
from tfq.proofs.kernel_check_attention import Bench
from tfq.proofs.kernel_check_config import CheckConfig
from tfq.proofs.kernel_check_rowwise import check_rowwise


def steps(cfg: CheckConfig) -> int:
    """Progress steps per backend: per dtype, stores, queries and rows per attention kernel, controls; then the
    row-wise layers."""
    per_dtype = 2 + 2 * len(cfg.attention) if cfg.attention else 0
    return len(cfg.dtypes) * per_dtype + ("rowwise" in cfg.kernels)


def run_check(cfg: CheckConfig, backends: list[Backend],
              progress: Callable[[str], None] = lambda what: None) -> list[Case]:
    cfg.validate()
    cases: list[Case] = []
    for backend in backends:
        for dtype in cfg.dtypes if cfg.attention else ():  # the cache: stores, then the attention kernels
            label = f"{backend.name} {dtype}"
            progress(f"{label}: stores")
            bench = Bench(cfg, backend, dtype)
            cases += bench.check_stores()
            queries = {}
            for kernel in cfg.attention:
                progress(f"{label}: {kernel} queries")
                case, queries[kernel] = bench.check_queries(kernel)
                cases.append(case)
                progress(f"{label}: {kernel} rows")
                cases.append(bench.check_rows(kernel, queries[kernel]))
            progress(f"{label}: controls")
            cases += bench.controls(queries)
        if "rowwise" in cfg.kernels:

            progress(f"{backend.name}: linear layers and RMS norm")
            cases += check_rowwise(backend, cfg.heads, cfg.head_dim, cfg.repeats, cfg.seed)
    return cases


def passed(cases: list[Case]) -> bool:
    return bool(cases) and all(c.ok for c in cases)


def report_json(cfg: CheckConfig, backends: list[Backend], cases: list[Case]) -> dict:
    return {
        "config": asdict(cfg),
        "backends": {b.name: b.where for b in backends},
        "passed": passed(cases),
        "cases": [dict(asdict(c), result=c.result) for c in cases],
    }
