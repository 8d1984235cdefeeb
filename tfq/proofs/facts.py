"""What a run's bits were produced on: the CPU, the instruction sets in use, the libraries and thread counts.
`tfq together`'s evidence and `tfq verify`'s records carry it."""
from __future__ import annotations

import os

from tfq.kernels import cpu_build


def build_facts() -> dict:
    """What ran: the CPU, the instruction sets in use (tfq's kernels' -march, torch's ATen capability, numpy's
    dispatched features), thread counts. The bits do not depend on them (docs/contract.md); a record says where
    it was made."""
    import platform

    import torch

    from tfq.engine.threads import FIXED_VARIABLES

    fixed = next((v for v in FIXED_VARIABLES if os.environ.get(v)), None)
    return {
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
        "march": cpu_build.march(),
        "lanes": cpu_build.lanes() if cpu_build.built() else "-",
        "cpu_kernels": _cpu_kernels(),
        "numpy": _numpy_facts(),
        "onednn": _onednn_facts(),
        "threads": torch.get_num_threads(),
        "thread_policy": f"fixed by {fixed}" if fixed else "follows the free cores, proved counts only",
    }


def _numpy_facts() -> str:
    """numpy's version and the features its dispatched loops use here (NPY_DISABLE_CPU_FEATURES takes some off)."""
    import numpy as np

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
        used = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    except ImportError:  # another numpy's layout: the version alone
        return np.__version__
    return f"{np.__version__} ({' '.join(used) or 'baseline'})"


def _cpu_kernels() -> str:
    from tfq.kernels.backend import torch_backend

    return torch_backend().where


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _onednn_facts() -> str:
    """oneDNN's version and the ISA it dispatches to, from its own verbose lines (written to fd 1)."""
    import sys
    import tempfile

    import torch

    if not torch.backends.mkldnn.is_available():
        return "not in this build"
    from tfq.kernels.rowwise import OneDnnLinear

    lin = OneDnnLinear(torch.ones(8, 8))
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                lin(torch.ones(2, 8))
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        lines = f.read().decode(errors="replace").splitlines()
    version = next((ln.split("info,", 1)[1] for ln in lines if ",info,oneDNN" in ln), "oneDNN")
    isa = next((ln.split("isa:", 1)[1] for ln in lines if ",isa:" in ln), "ISA not reported")
    return f"{version.split(' (')[0]}, {isa}"
