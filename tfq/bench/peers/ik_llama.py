"""The ik_llama.cpp peer (`--peer ik_llama.cpp`): ik_llama.cpp, the llama.cpp fork with its own CPU matrix kernels
("iqk"), on the same GGUF file as `--peer llama.cpp` runs (the file as shipped beside tfq's quantized weights, its
F32 twin beside fp32), through the ctypes API of the `ik-llama-cpp-python` sdist.

That sdist's own pip build stops (it asks git for build info), so benchmarks/build_ik_llama.sh builds its vendored
ik_llama.cpp for this CPU with cmake and lays libllama.so and libggml.so beside the sdist's Python package, in
$TFQ_CACHE/ik_llama/ (or the folder TFQ_IK_LLAMA names); the wrapper finds them in its package folder.

It runs like the llama.cpp peer (tfq.bench.peers.llama.LlamaPeer, whose batch loop it keeps: one sequence id a
stream, one llama_decode a step) in the bench's child process, so a crash never takes tfq down. Greedy draws are
an argmax over the logits array in numpy, not the wrapper's sampler, which loops over the vocabulary in Python
(tens of milliseconds a token on a 150k vocabulary): the peer's sampling costs what tfq's does. The context takes
ik_llama.cpp's defaults beyond its size and threads (what a user of its API gets), flash attention on, with one
exception: a context of several sequences runs without flash attention, because ik_llama.cpp's own flash-attention
kernels abort on it (GGML_ASSERT(S > 0) in iqk_fa_templates.h, 0.1.5's sources, as soon as n_seq_max > 1, even on
one sequence's prompt). Run-time repacking is off, as it is by default (its load copies every repacked tensor out
of the mapped file).

A model ik_llama.cpp cannot load (an architecture or tensor type its build does not know) is refused (Refused):
one line, and the bench carries on with tfq's rows alone.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tfq.bench.peers.llama import LlamaPeer
from tfq.errors import TfqError

NAME = "ik_llama.cpp"
BUILD = "nice -n 10 bash benchmarks/build_ik_llama.sh"  # 10-20 minutes on two cores
_SILENT = None  # the log callback that drops ik_llama.cpp's messages (kept alive here: it holds a pointer)


class Refused(TfqError):
    """ik_llama.cpp cannot run this model (an architecture or tensor type its build does not know): the child
    answers it marked `refused`, and the bench's rows stand without the peer's."""

    refused = True


def ik_folder() -> Path:
    """The folder that holds the built ik_llama_cpp package: TFQ_IK_LLAMA, else $TFQ_CACHE/ik_llama (torch-free,
    as the child's imports must be)."""
    named = os.environ.get("TFQ_IK_LLAMA")
    if named:
        return Path(named).expanduser()
    cache = os.environ.get("TFQ_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tfq"
    return Path(cache).expanduser() / "ik_llama"


def require_ik_llama() -> str:
    """The wrapper's version with its libraries loaded, or one line on how to build them."""
    folder = ik_folder()
    if not (folder / "ik_llama_cpp" / "lib" / "libllama.so").is_file():
        raise TfqError(f"--peer {NAME} needs ik_llama.cpp built for this machine, and {folder} holds no build; "
                       f"build it once with: {BUILD} (10-20 minutes on two cores; TFQ_IK_LLAMA names another "
                       f"build), or pass --peer llama.cpp, hf or none")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        import ik_llama_cpp
    except (ImportError, OSError) as e:  # a library that does not load here: another CPU's or another wrapper's
        raise TfqError(f"--peer {NAME}: the build in {folder} does not load here ({' '.join(str(e).split())[:200]}); "
                       f"rebuild it with: {BUILD}") from None
    return f"ik-llama-cpp-python {ik_llama_cpp.__version__}"


class IkLlamaPeer(LlamaPeer):
    """ik_llama.cpp on one GGUF file: LlamaPeer's batches and greedy draw, through ik_llama.cpp's older API."""

    ENGINE = NAME

    def __init__(self, path: Path, threads: int, name: str):
        import ctypes

        self.model = self.ctx = self.batch = None  # close() runs on any failure below
        self.version = require_ik_llama()
        from ik_llama_cpp import _ctypes_api as L

        self.L, self.path, self.name, self.threads = L, path, name, threads
        global _SILENT
        if _SILENT is None:  # it logs every load to stderr; its failures reach tfq as return codes
            _SILENT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
            L._lib.llama_log_set.argtypes = [type(_SILENT), ctypes.c_void_p]
        L._lib.llama_log_set(_SILENT, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise Refused(f"{NAME} cannot load {path.name} (an architecture or tensor type its build, "
                          f"{self.version}, does not know?)")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.lanes = 0

    def context_params(self, cp, lanes: int, rows: int):
        cp = super().context_params(cp, lanes, rows)
        cp.flash_attn = cp.flash_attn and lanes == 1  # its flash attention aborts with several sequences
        return cp

    def _clear(self) -> None:
        self.L.llama_kv_cache_clear(self.ctx)

    def close(self) -> None:
        self._free_context()
        if self.model:
            self.L.llama_free_model(self.model)
            self.model = None
