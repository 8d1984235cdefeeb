"""tfq's C++ kernels for the CPU (kernels/cpu/*.cpp): built once per machine by torch's extension builder, then
loaded as torch ops (torch.ops.tfq_cpu.*).

The build uses the machine's own instruction set (-march=native), so its folder is named after the CPU: a home
folder shared between machines never hands one of them another's build. Floating-point contraction is off, so
the compiler fuses nothing the source does not (the kernels' sums are exact recipes, kernels/cpu/linear.cpp).
Where no compiler or ninja is at hand the build fails with a reason, and the caller keeps torch's oneDNN path.

TFQ_CPU_KERNELS picks the CPU kernels: `auto` (the default: tfq's kernels when they build, else torch's), `tfq`
(tfq's, or an error saying why they cannot build) or `torch` (oneDNN linear layers, attention as bmm items).
TFQ_CPU_MARCH builds them for another instruction set than this CPU's (`haswell`, `x86-64`, any -march gcc
knows; default `native`): the same bits by construction (docs/contract.md), which `tfq verify` and the tests
show on each; `x86-64` is the baseline every x86-64 CPU runs.
"""
from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

SOURCES = ("linear.cpp", "attention.cpp", "rowwise.cpp", "layer.cpp", "quant.cpp", "quant_q8.cpp", "delta.cpp",
           "delta_layer.cpp", "moe.cpp", "workers.cpp", "pool.cpp", "memory.cpp")
HEADERS = ("lanes.h", "panel.h", "layer_parts.h", "attention_part.h", "moe_parts.h", "delta_part.h", "quant_blob.h",
           "checks.h", "claims.h", "pool.h", "ops.h", "row_facts.h", "memory.h")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
CHOICES = ("auto", "tfq", "torch")
OPS = ("pack", "linear", "attend", "rms_norm", "silu", "layer", "qpack", "qcat", "qlinear", "deltanet",
       "gated_rms_norm", "sigmoid_gate", "delta_layer", "qpack_q8", "fma", "lanes", "moe_route",
       "moe_mixture", "stack_forward", "release_workers", "q8_prefetch", "qlinear_glu", "pool_counts",
       "pool_release", "row_facts", "lasting_blocks")
EMULATED = "SSE2, fma emulated"  # lanes.h's path for x86-64 without FMA: the same bits, many times slower

_state: dict[str, object] = {}  # once a process: "ok" -> bool, "why" -> str


def choice() -> str:
    value = os.environ.get("TFQ_CPU_KERNELS", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"TFQ_CPU_KERNELS={value!r}: choose auto, tfq (tfq's C++ kernels) or torch (oneDNN, bmm)")
    return value


def march() -> str:
    """The instruction set the kernels are built for: TFQ_CPU_MARCH, else the machine's own."""
    value = os.environ.get("TFQ_CPU_MARCH", "native").strip() or "native"
    if not value.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"TFQ_CPU_MARCH={value!r}: name an -march gcc knows (native, haswell, x86-64, armv8-a)")
    return value


def flags() -> list[str]:
    return [*FLAGS, f"-march={march()}"]


def _cpu_tag() -> str:
    """What decides the build: the CPU's features, the compiler flags, the sources, torch's version."""
    import torch

    features = ""
    try:
        with open("/proc/cpuinfo") as f:
            features = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        features = platform.processor()
    h = hashlib.sha256(" ".join((features, *flags(), torch.__version__, platform.machine())).encode())
    for source in SOURCES + HEADERS:
        h.update((Path(__file__).parent / "cpu" / source).read_bytes())
    return h.hexdigest()[:12]


def wanted() -> bool:
    """Whether this process runs tfq's kernels: chosen (or auto) and built. Raises what a bad choice is."""
    pick = choice()
    if pick == "torch":
        return False
    ok, why = load()
    if not ok and pick == "tfq":
        raise RuntimeError(f"TFQ_CPU_KERNELS=tfq, but {why}")
    return ok


def name() -> str:
    """The build's name (and its folder's) for this CPU, these flags, sources and torch."""
    return f"tfq_cpu_{_cpu_tag()}"


def cached() -> bool:
    """Whether this machine has the build already (loading it then takes a moment, not a compile)."""
    from torch.utils import cpp_extension

    folder = Path(cpp_extension._get_build_directory(name(), verbose=False))
    return (folder / f"{name()}.so").is_file()


def ops():
    """torch.ops.tfq_cpu, built and loaded (RuntimeError saying why not)."""
    import torch

    if not _state.get("ok"):
        ok, why = load()
        if not ok:
            raise RuntimeError(why)
    return torch.ops.tfq_cpu


def op(name: str):
    """torch.ops.tfq_cpu.<name>.default, looked up once: a decode step calls the ops hundreds of times, and the
    packet's own dispatch costs more than the small ones' work."""
    handles = _state.setdefault("handles", {})
    if name not in handles:
        handles[name] = getattr(ops(), name).default
    return handles[name]


def lanes() -> str:
    """The vector path of the loaded build (lanes.h): AVX-512, AVX2 + FMA, SSE (+ FMA, or emulated) or plain C++."""
    return str(ops().lanes())


def built() -> bool:
    """Whether this process has the kernels loaded already (cheap)."""
    return bool(_state.get("ok"))


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package `ninja` (a dependency) puts it beside the
    interpreter, which is not on PATH when python is run by its full path. Add it there if needed."""
    import shutil

    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


STALE_LOCK_S = 600.0  # a first build takes about 30 s here; a lock this old belongs to a build that was killed


def clear_stale_lock(build_dir: Path) -> None:
    """torch's builder takes a lock file in the build folder and waits for it forever: a build killed midway (a
    Ctrl-C during the first use) would hang every later run. A lock older than STALE_LOCK_S is removed."""
    import time

    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:
        pass  # no lock, or another process took it away first


def load() -> tuple[bool, str]:
    """Build (once per machine) and load the kernels; (True, where) or (False, why not)."""
    if "ok" in _state:
        return bool(_state["ok"]), str(_state["why"])
    try:
        import torch
        from torch.utils import cpp_extension

        _ninja_on_path()
        folder = Path(__file__).parent / "cpu"
        clear_stale_lock(Path(cpp_extension._get_build_directory(name(), verbose=False)))
        cpp_extension.load(name=name(), sources=[str(folder / s) for s in SOURCES],
                           extra_cflags=flags(), extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=False)
        ok = all(hasattr(torch.ops.tfq_cpu, op) for op in OPS)
        why = "tfq's fixed-order kernels (built for " + ("this CPU)" if march() == "native" else f"-march={march()})")
    except Exception as e:  # a missing compiler or ninja, a failed build: many kinds, one line
        ok, why = False, f"tfq's CPU kernels did not build ({' '.join(str(e).split())[:200]})"
    _state.update(ok=ok, why=why)
    return ok, why
