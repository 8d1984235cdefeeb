"""What a decode step must read (the roofline), how fast this machine reads memory, and resident memory
around a run."""
from __future__ import annotations

import os
import resource
import time

import torch

from tfq.model.config import ModelConfig
from tfq.plan import row_bytes

BANDWIDTH_MIB = 256  # well past any CPU cache
BANDWIDTH_TRIES = 7


# ---------------------------------------------------------------------------------------- the roofline

def weights_read_bytes(config: ModelConfig) -> int:
    """fp32 bytes a decode step reads of the weights: every linear layer, the norms and the output head.
    The embedding is a lookup of a few rows; when it is tied to the head, the head reads it whole."""
    untied_embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    return (config.param_count() - untied_embedding) * 4


def mean_context(prompt_tokens: int, tokens: int) -> float:
    """Mean keys per stream over the decode steps: step j (1..tokens-1) attends over prompt + j positions."""
    return prompt_tokens + tokens / 2


def kv_read_bytes(config: ModelConfig, kv_dtype: str, lanes: int, context: float) -> float:
    return lanes * context * row_bytes(config, kv_dtype)


def measure_bandwidth(mib: int = BANDWIDTH_MIB, tries: int = BANDWIDTH_TRIES) -> dict[int, float]:
    """Bytes/s of a streaming read (a sum over a tensor far larger than the caches), with one thread and with
    torch's threads as the engines use them: {threads: bytes/s}. Each is the second best of `tries` (a rate
    reached twice, so one glitch of the clock cannot set the roofline); on a shared machine a thread may wait
    for a busy core, so the caller takes the best of the thread counts."""
    a = torch.rand(mib * 2**20 // 4)  # distinct pages: nothing a hypervisor could merge
    a.sum()
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            times = []
            for _ in range(tries):
                t0 = time.perf_counter()
                a.sum()
                times.append(time.perf_counter() - t0)
            out[n] = a.nbytes / sorted(times)[1]
    finally:
        torch.set_num_threads(threads)
    return out


# -------------------------------------------------------------------------------------------- memory

class MemoryProbe:
    """Resident memory of this process around one run. On Linux, writing 5 to /proc/self/clear_refs resets
    the peak (VmHWM) to the present, so each run's peak is its own; elsewhere the peak is the process's
    lifetime peak (ru_maxrss) and a run's own growth is unknown (None)."""

    def __init__(self):
        self.resettable = self._reset()
        self.before = 0

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> None:
        if self.resettable:
            self._reset()
        self.before = _status("VmRSS") or 0

    def stop(self) -> tuple[int, int | None]:
        """(peak resident bytes, bytes the run added above the resident memory it started with)."""
        if self.resettable:
            peak = _status("VmHWM") or 0
            return peak, max(0, peak - self.before)
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return usage * (1 if os.uname().sysname == "Darwin" else 1024), None


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
