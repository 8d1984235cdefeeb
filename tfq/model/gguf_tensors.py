"""A GGUF file's tensors as HF parameters: llama.cpp's tensor names mapped to HF's, each tensor dequantized
to float32 (by `gguf.quants.dequantize`) in its row-major shape, or, for `weights: gguf`, the quantized
matrices kept in their blocks (`kept_tensors`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tfq.errors import TfqError
from tfq.model.gguf_header import GgufHeader, TensorInfo

# llama.cpp's names: a layer's tensors are blk.N.<name>, model.layers.N.<HF name> in HF's checkpoints
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The HF parameter name of a GGUF tensor name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(name)


def tensor_names(h: GgufHeader) -> list[tuple[str, TensorInfo]]:
    """(HF name, tensor) for every tensor, in HF name order; TfqError on a tensor tfq does not know."""
    out = []
    for t in h.tensors:
        try:
            out.append((hf_name(t.name), t))
        except KeyError:
            raise TfqError(f"{h.path}: unexpected tensor {t.name!r}; tfq reads qwen2/qwen3 GGUF files") from None
    return sorted(out, key=lambda p: p[0])


def dequantized(h: GgufHeader, data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """One tensor as float32, in its row-major shape."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.ggml_type)
    rows = t.shape[:-1]
    raw = data[t.offset:t.offset + t.n_bytes].reshape(*rows, t.n_bytes // max(1, int(np.prod(rows, dtype=np.int64))))
    try:
        out = dequantize(raw, qtype)
    except NotImplementedError:
        raise TfqError(f"{h.path}: tensor {t.name} is {qtype.name}, which the gguf package cannot dequantize") from None
    out = np.asarray(out, dtype=np.float32).reshape(t.shape)
    return out


def iter_tensors(h: GgufHeader) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) in HF name order, one dequantized at a time."""
    names = tensor_names(h)
    data = np.memmap(h.path, dtype=np.uint8, mode="r")
    for name, t in names:
        yield name, dequantized(h, data, t)


class FileBytes:
    """A GGUF file mapped read-only: each tensor's bytes as a numpy view, and its pages let go once read (the
    file's pages would otherwise count in the process's resident memory beside the kept copy)."""

    def __init__(self, path):
        import mmap

        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self.map, dtype=np.uint8)

    def of(self, t: TensorInfo) -> np.ndarray:
        return self.data[t.offset:t.offset + t.n_bytes]

    def release(self, t: TensorInfo) -> None:
        import mmap

        page = mmap.PAGESIZE
        start = t.offset // page * page
        if hasattr(self.map, "madvise"):
            self.map.madvise(mmap.MADV_DONTNEED, start, t.offset + t.n_bytes - start)


class BlockRows:
    """A table (the embedding) left in its file's blocks on the mapped file: a lookup dequantizes just the rows
    it reads, with the same values a kept matrix unpacks to (`Quantized.rows`), and only those rows' pages become
    resident."""

    def __init__(self, kind: str, raw: np.ndarray, shape: tuple[int, int], h: GgufHeader, t: TensorInfo):
        self.kind, self.raw, self.shape = kind, raw.reshape(shape[0], -1), tuple(shape)
        self._h, self._t = h, t

    def rows(self, ids):
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        picked = self.raw[ids.cpu().numpy()]
        if self.kind in FORMATS:
            return from_blocks(self.kind, picked, (len(picked), self.shape[1])).dequantized().to(ids.device)
        t = TensorInfo(self._t.name, self._t.dims[:1] + (len(picked),), self._t.ggml_type, 0, picked.size)
        return torch.from_numpy(np.array(dequantized(self._h, picked.reshape(-1), t))).to(ids.device)

    def quantized(self):
        """The whole table as a matrix the quantized kernel computes with (a head tied to the embedding)."""
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        if self.kind in FORMATS:
            return from_blocks(self.kind, self.raw, self.shape)
        return torch.from_numpy(np.array(dequantized(self._h, self.raw.reshape(-1), self._t)))


EMBEDDING = "model.embed_tokens.weight"


def kept_tensors(h: GgufHeader):
    """Every tensor by its HF name, each read from the mapped file when the model takes it (LazyTensors): a
    matrix in a format tfq's quantized kernel computes with (tfq.kernels.quant.FORMATS) as `Quantized`, the
    embedding as `BlockRows` on the file, anything else (F32, F16, other quantizations, vectors) dequantized
    to a float32 torch tensor, as `weights: fp32` has it."""
    from gguf.constants import GGMLQuantizationType

    from tfq.model.lazy import LazyTensors

    names = dict(tensor_names(h))
    data = FileBytes(h.path)

    def read(name: str):
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        t = names[name]
        kind = GGMLQuantizationType(t.ggml_type).name
        if name == EMBEDDING and len(t.shape) == 2:
            return BlockRows(kind, data.of(t), t.shape, h, t)
        if kind in FORMATS and len(t.shape) == 2:
            out = from_blocks(kind, data.of(t), t.shape)
        else:
            out = torch.from_numpy(np.array(dequantized(h, data.data, t)))
        data.release(t)
        return out

    return LazyTensors(list(names), read)


@dataclass(frozen=True)
class KeptWeights:
    """What `weights: gguf` keeps of a file, from its header alone."""

    resident: int  # bytes the loaded model holds: every blob, fp32 tensors, and the embedding's file bytes
    step: int  # bytes a decode step reads of them (the embedding is a lookup unless the head shares it)
    fp32: int  # the same step in fp32
    embedding: int  # the embedding's bytes, left on the mapped file (resident as its rows are read)
    counts: dict  # matrices by how they are kept: their GGUF type, or "fp32"


def kept_summary(h: GgufHeader) -> KeptWeights:
    """The bytes `kept_tensors` and the model keep, counted as kernels/cpu/quant.cpp lays each matrix out
    (tfq.kernels.quant.format_bytes): what the plan's weights line says and its total counts."""
    from gguf.constants import GGMLQuantizationType

    from tfq.kernels.quant import KEPT, format_bytes

    counts: dict[str, int] = {}
    resident = step = fp32 = embedding = 0
    tied = not any(t.name == "output.weight" for t in h.tensors)
    for t in h.tensors:
        size = int(np.prod(t.shape, dtype=np.int64))
        kind = GGMLQuantizationType(t.ggml_type).name
        kept = kind in KEPT and len(t.shape) == 2
        if len(t.shape) == 2:
            counts[kind if kept else "fp32"] = counts.get(kind if kept else "fp32", 0) + 1
        matrix = format_bytes(kind, *t.shape) if kept else 4 * size
        if t.name == "token_embd.weight":
            embedding = t.n_bytes if len(t.shape) == 2 else 4 * size
            resident += embedding
            if not tied:
                continue
            resident += matrix  # the head computes with the embedding's blocks, packed
        else:
            resident += matrix
        fp32 += 4 * size
        step += matrix
    return KeptWeights(resident, step, fp32, embedding, counts)
