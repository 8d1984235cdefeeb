"""The llama.cpp peer: llama.cpp (through llama-cpp-python) on the same GGUF file tfq converted, timed like a
tfq run.

tfq's fp32 weights are the GGUF's tensors dequantized, so the like-for-like peer is llama.cpp on an F32 GGUF
of those same values (`--peer llama.cpp`): written once next to tfq's cache from the file, every quantized
tensor dequantized by the `gguf` package, every other entry copied. `--peer llama.cpp-gguf` runs the file as
shipped, at its own quantized bits, for reference (what a user of llama.cpp gets; not what tfq computes).

LlamaPeer runs llama.cpp in the process that makes it: the bench's peer makes it in a child process
(tfq.bench.peers.child_end, driven by tfq.bench.peers.parent_end), so a crash of llama.cpp never takes tfq down.

Several streams at once go through llama.cpp's batch API (one sequence id a stream, one `llama_decode` a step,
as its batched bench does); greedy draws are the argmax of each stream's logits row, so the peer's sampling
costs what tfq's does.
"""
from __future__ import annotations

import time
from pathlib import Path

from tfq.bench.memory import MemoryProbe
from tfq.bench.record import Run
from tfq.errors import TfqError

LLAMA_INSTALL = 'pip install -e ".[peer-llama]"'  # builds llama.cpp from source: minutes on two cores
F32 = 0  # GGML_TYPE_F32; general.file_type ALL_F32
_SILENT = None  # the log callback that drops llama.cpp's messages (kept alive here: llama.cpp holds a pointer)


def peer_gguf(spec: str, quantized: bool, progress: bool = True, peer: str = "llama.cpp") -> Path:
    """The GGUF file the peer runs for the model `spec`: the file as shipped (quantized=True), or its F32
    twin, written once into tfq's cache. An HF folder has no GGUF: one line saying so."""
    from tfq.model import default
    from tfq.model.source import cache_dir, file_sha256, gguf_path, write_once

    folder = cache_dir() / "peer"
    source = gguf_path(spec, progress)
    if source is None:
        raise TfqError(f"--peer {peer} runs a GGUF file, and the model {spec} is not one; bench a .gguf "
                       f"model (or the default one), or pass --peer hf")
    sha = default.SHA256 if spec == "default" else file_sha256(source, progress)
    if quantized:
        return source
    target = folder / f"{sha}-f32.gguf"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_once(target, lambda tmp: write_f32_gguf(source, tmp, progress))
    return target


def write_f32_gguf(source: Path, dest: Path, progress: bool = True) -> None:
    """`source` with every tensor stored as F32 (quantized ones dequantized); metadata copied as it is."""
    import gguf
    import numpy as np
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(source))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dest), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in tqdm(reader.tensors, desc="writing the llama.cpp peer's F32 file", disable=not progress, leave=False):
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def require_llama() -> str:
    """llama-cpp-python's version, or one line on how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise TfqError(f"--peer llama.cpp needs llama-cpp-python, which is not installed; install it with: "
                       f"{LLAMA_INSTALL} (it builds llama.cpp from source, minutes on two cores), or pass "
                       f"--peer hf or none") from None
    return llama_cpp.__version__


class LlamaPeer:
    """llama.cpp on one GGUF file: one context sized for `lanes` streams of `rows` rows each, reused by every
    run (its cache cleared between runs)."""

    ENGINE = "llama.cpp"  # the runs' engine (tfq.bench.peers.ik_llama's subclass names its own)

    def __init__(self, path: Path, threads: int, name: str):
        import llama_cpp as L

        self.L, self.path, self.name, self.threads = L, path, name, threads
        self.version = require_llama()
        global _SILENT
        if _SILENT is None:  # llama.cpp logs every load to stderr; its failures reach tfq as return codes
            _SILENT = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(_SILENT, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise TfqError(f"llama.cpp cannot load {path}; "
                           f"is it a GGUF file of a model llama.cpp {self.version} knows?")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = self.batch = None
        self.lanes = 0

    def prepare(self, lanes: int, rows: int) -> None:
        """A context for `lanes` streams of `rows` rows each (made anew for each lane count)."""
        L = self._free_context()
        cp = self.context_params(L.llama_context_default_params(), lanes, rows)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise TfqError(f"{self.ENGINE} cannot make a context of {lanes} x {rows} rows for {self.path}")
        self.batch = L.llama_batch_init(cp.n_ctx, 0, 1)
        self.lanes = lanes

    def context_params(self, cp, lanes: int, rows: int):
        """The library's default context parameters, sized for `lanes` streams of `rows` rows on our threads."""
        cp.n_ctx = lanes * rows
        cp.n_batch = cp.n_ctx  # every stream's prompt in one llama_decode (it splits into ubatches itself)
        cp.n_seq_max = lanes
        cp.n_threads = cp.n_threads_batch = self.threads
        if "no_perf" in dict(type(cp)._fields_):  # llama.cpp's; ik_llama.cpp's older structure has no such field
            cp.no_perf = True
        return cp

    def _free_context(self):
        L = self.L
        if self.ctx:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = self.batch = None
        return L

    def close(self) -> None:
        self._free_context()
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        self.close()

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits), in one llama_decode."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise TfqError(f"{self.ENGINE}'s llama_decode returned {rc} "
                           f"(its context of {self.lanes} streams is too small?)")

    def _greedy(self, rows: list[int]) -> list[int]:
        """The argmax of the last forward's logits at these batch rows (each one that asked for logits)."""
        import numpy as np

        out = []
        for i in rows:
            row = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
            out.append(int(row.argmax()))
        return out

    def _clear(self) -> None:
        """Every stream's cache emptied, for the next run."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def run(self, prompts: list[list[int]], tokens: int, round_: int, probe: MemoryProbe) -> Run:
        self._clear()
        n = len(prompts[0])
        probe.start()
        t0 = time.perf_counter()
        rows = [(tok, pos, s, pos == n - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        self._decode(rows)
        replies = [[t] for t in self._greedy([s * n + n - 1 for s in range(len(prompts))])]
        first = time.perf_counter() - t0
        for j in range(1, tokens):
            self._decode([(r[-1], n + j - 1, s, True) for s, r in enumerate(replies)])
            for r, t in zip(replies, self._greedy(list(range(len(prompts))))):
                r.append(t)
        total = time.perf_counter() - t0
        peak, grown = probe.stop()
        return Run(self.ENGINE, "peer", len(prompts), round_, first, total, tokens - 1, replies, peak, grown)

