"""What a decode step must read (the roofline) and how fast this machine reads memory. Resident memory around
a run is tfq.bench.memory's (torch-free: the peer's child process measures itself with it)."""
from __future__ import annotations

import functools
import glob
import time
from pathlib import Path

import torch

from tfq.model.config import ModelConfig
from tfq.plan import row_bytes

BANDWIDTH_MIB = 256  # the probes' least size; more where a cache is large (probe_mib)
BANDWIDTH_PART_MIB = 256  # the linear probe's weight, as layers of at most this (each packed while one copy is held)
BANDWIDTH_TRIES = 7


# ---------------------------------------------------------------------------------------- the roofline

def weights_read_bytes(config: ModelConfig, model=None, lanes: int = 1) -> int:
    """Bytes a decode step of `lanes` rows reads of the weights: every linear layer, the norms and the output head,
    in fp32, or, given the loaded model, each quantized layer at its own width with its scales (weights: gguf).
    The embedding is a lookup of a few rows; when it is tied to the head, the head reads it whole. A mixture's
    step reads the experts its rows chose: the distinct ones expected were the router's choices uniform."""
    if model is None:
        return round(4 * config.read_params(lanes))
    untied_embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    fp32 = (config.param_count() - untied_embedding) * 4
    m = config.moe
    unread = 0 if m is None else 1 - m.expected_distinct(lanes) / m.experts  # the share of experts not read
    from tfq.model.layers import linears

    size = lambda f: f.nbytes if hasattr(f, "nbytes") else 4 * f.out_features * f.in_features  # noqa: E731
    every, experts = [], []
    for layer in model.layers:
        every += linears(layer).values()
        if layer.moe is not None:
            mix = layer.moe
            every += [mix.router] + [f for e in [mix.shared] if e for f in (e.gate_up, e.down)]
            every += [mix.shared_gate] if mix.shared_gate else []
            experts += [f for e in mix.experts for f in (e.gate_up, e.down)]
    kept = [f for f in every + experts + [model.lm_head] if hasattr(f, "nbytes")]
    return round(fp32 - sum(4 * f.out_features * f.in_features - f.nbytes for f in kept)
                 - unread * sum(size(f) for f in experts))


def mean_context(prompt_tokens: int, tokens: int) -> float:
    """Mean keys per stream over the decode steps: step j (1..tokens-1) attends over prompt + j positions."""
    return prompt_tokens + tokens / 2


def kv_read_bytes(config: ModelConfig, kv_dtype: str, lanes: int, context: float) -> float:
    """Keys and values a decode step reads, and a hybrid's states (each read and written back once)."""
    return lanes * (context * row_bytes(config, kv_dtype) + 2 * config.state_bytes)


def largest_cache_bytes(cpus: str = "/sys/devices/system/cpu") -> int:
    """The most bytes one level of CPU cache holds on this machine, every instance of it counted once (a chip's
    L3 slices, each core's L2), from Linux's sysfs; 0 where it says nothing."""
    levels: dict[str, dict[str, int]] = {}  # level -> the CPUs an instance serves -> its bytes
    for index in glob.glob(f"{cpus}/cpu[0-9]*/cache/index[0-9]*"):
        try:
            level, shared, text = (Path(index, name).read_text().strip() for name in ("level", "shared_cpu_list",
                                                                                        "size"))
        except OSError:
            continue
        digits, unit = text.rstrip("KMGkmg"), {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        if digits.isdigit():
            levels.setdefault(level, {})[shared] = int(digits) * unit
    return max((sum(instances.values()) for instances in levels.values()), default=0)


def probe_mib() -> int:
    """How large the probes' tensors are: four times the largest cache, in steps of 256 MiB, at least BANDWIDTH_MIB
    and at most a quarter of the memory available now. A cache keeps part of a stream not much larger than itself:
    on a Xeon VM with 300 MiB of L3 a probe of 256 MiB read 52-60 GB/s, one of 600 MiB 39-42, 1 GiB 34-36 and 1.5 GiB
    31-33 (2026-12-06)."""
    want = -(-4 * largest_cache_bytes() // (256 * 2**20)) * 256
    return max(BANDWIDTH_MIB, min(want, _available_mib() // 4 // 256 * 256))


def _available_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 1 << 30  # unknown: no cap


def measure_bandwidth(mib: int | None = None, tries: int = BANDWIDTH_TRIES) -> dict[str, float]:
    """Bytes/s this machine reads, by probe: {"what, N threads, M MiB": bytes/s}. The probes read tensors of `mib`
    MiB (probe_mib: far larger than the caches):

    - `linear`: the engine's own linear layer (the CPU backend's) over weights of `mib` MiB (layers of at most
      BANDWIDTH_PART_MIB, one after another) for one and for two rows, the way a decode step streams its weights;
      its rate is what a step can reach, so it sets the roofline.
    - `sum`: a plain reduction over a tensor of `mib` MiB, with one thread and with torch's threads.

    Each is the second best of `tries` (a rate reached twice, so one glitch of the clock cannot set the
    roofline); the report takes the best probe (on a shared machine the best read is the nearest to the
    physical limit)."""
    mib = mib or probe_mib()
    threads = torch.get_num_threads()
    out = {f"linear {rows} row{'s' * (rows > 1)}, {_threads(threads)}, {mib} MiB": rate
           for rows, rate in _linear_rates(mib, tries).items()}  # its weights freed before the sum's tensor is made
    a = torch.rand(mib * 2**20 // 4)
    a.sum()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            out[f"sum, {_threads(n)}, {mib} MiB"] = a.nbytes / _second_best(a.sum, tries)
    finally:
        torch.set_num_threads(threads)
    return out


def _linear_rates(mib: int, tries: int) -> dict[int, float]:
    """Rows -> bytes/s of the CPU backend's linear layer streaming weights of `mib` MiB."""
    from tfq.kernels.backend import torch_backend

    inner, layers = 896, []
    for start in range(0, mib, BANDWIDTH_PART_MIB):  # random values: distinct pages, nothing a hypervisor could merge
        layers.append(torch_backend().linear(torch.rand(min(BANDWIDTH_PART_MIB, mib - start) * 2**20 // 4 // inner,
                                                        inner)))
    nbytes, rates = sum(layer.out_features for layer in layers) * inner * 4, {}
    for rows in (1, 2):
        stream = functools.partial(_each, layers, torch.rand(rows, inner))
        stream()
        rates[rows] = nbytes / _second_best(stream, tries)
    return rates


def _each(layers: list, x: torch.Tensor) -> None:
    for layer in layers:
        layer(x)


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n > 1)}"


def _second_best(work, tries: int) -> float:
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]
