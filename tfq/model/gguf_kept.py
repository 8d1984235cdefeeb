"""A GGUF model's weights kept in their file's blocks (`weights: gguf`): each matrix in a format tfq's quantized
kernel computes with stays in its blocks, the embedding stays on the mapped file (`BlockRows`), everything else is
dequantized to float32 as `weights: fp32` has it (tfq/model/gguf_tensors.py); and what that keeps, summed without
loading (`kept_summary`)."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

from tfq.model.gguf_header import GgufHeader, TensorInfo
from tfq.model.gguf_tensors import (
    EXPERT_MATRIX,
    FileBytes,
    dequantized,
    fp32_value,
    hf_layouts,
    matrices,
    model_name,
    tensor_names,
)

ROWS_KEPT = 16 * 2**20  # bytes of a table's most recently looked-up rows kept unpacked (within FIXED_OVERHEAD)
FEW_ROWS = 8  # lookups of at most this many rows go through the kept rows (decode steps); more are unpacked whole


class BlockRows:
    """A table (the embedding) left in its file's blocks on the mapped file: a lookup dequantizes just the rows
    it reads, with the same values a kept matrix unpacks to (`Quantized.rows`), and only those rows' pages become
    resident. A decode step's few rows come from the most recent rows looked up, kept unpacked (up to ROWS_KEPT
    bytes): a token seen again costs no unpacking (a third of a millisecond a step on the default model), and the
    values are the same. `activations`: how a head tied to it computes (Quantized.activations). It keeps the
    file's path, not its header, whose tokenizer strings are tens of MB."""

    def __init__(self, kind: str, data: FileBytes, t: TensorInfo, activations: str = "fp32"):
        from collections import OrderedDict

        self.kind, self.raw, self.shape = kind, data.of(t).reshape(t.shape[0], -1), tuple(t.shape)
        self._data, self._t, self.activations = data, t, activations
        self._file = open(data.path, "rb", buffering=0)  # rows are read with pread (`picked`); closed with it
        self.kept: OrderedDict = OrderedDict()  # token id -> its row, least recently used first
        self.most_kept = max(1, ROWS_KEPT // (4 * self.shape[1]))

    def rows(self, ids):
        import torch

        if len(ids) > FEW_ROWS:
            return self.unpacked(ids)
        keys = ids.tolist()
        missing = [i for i in dict.fromkeys(keys) if i not in self.kept]
        if missing:
            for i, row in zip(missing, self.unpacked(torch.tensor(missing))):
                self.kept[i] = row.clone()  # its own memory: what ROWS_KEPT counts
        for i in keys:
            self.kept.move_to_end(i)
        out = torch.stack([self.kept[i] for i in keys]).to(ids.device)
        while len(self.kept) > self.most_kept:
            self.kept.popitem(last=False)
        return out

    def unpacked(self, ids):
        """Rows `ids` dequantized from the blocks."""
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        picked = self.picked(ids.cpu().numpy())
        if self.kind in FORMATS:
            return from_blocks(self.kind, picked, (len(picked), self.shape[1])).dequantized().to(ids.device)
        t = TensorInfo(self._t.name, self._t.dims[:1] + (len(picked),), self._t.ggml_type, 0, picked.size)
        return torch.from_numpy(np.array(dequantized(self._data.path, picked.reshape(-1), t))).to(ids.device)

    def picked(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids`' bytes, read from the file: they come from the page cache without becoming this process's
        resident memory, where reading them on the mapping maps the 64 KiB about each row (the start-up guard's few
        hundred lookups kept 40 MB of the default model's table resident)."""
        if len(ids) and not (0 <= ids.min() and ids.max() < self.shape[0]):  # a read past it would be other bytes
            raise IndexError(f"rows {ids.tolist()} of a table of {self.shape[0]} rows")
        width = self.raw.shape[1]
        out = np.empty((len(ids), width), dtype=np.uint8)
        for j, i in enumerate(ids.tolist()):
            out[j] = np.frombuffer(os.pread(self._file.fileno(), width, self._t.offset + i * width), dtype=np.uint8)
        return out

    def quantized(self):
        """The whole table as a matrix the quantized kernel computes with (a head tied to the embedding)."""
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        if self.kind in FORMATS:
            out = from_blocks(self.kind, self.raw, self.shape).with_activations(self.activations)
        else:
            whole = dataclasses.replace(self._t, offset=0)  # offsets into `raw`, the tensor's own bytes
            out = torch.from_numpy(np.array(dequantized(self._data.path, self.raw.reshape(-1), whole)))
        self._data.release(self._t)  # the copy is made: the table's mapped pages go (rows are read with pread)
        return out


EMBEDDING = "model.embed_tokens.weight"


def kept_tensors(h: GgufHeader, activations: str = "fp32"):
    """Every tensor by its HF name, each read from the mapped file when the model takes it (LazyTensors): a
    matrix in a format tfq's quantized kernel computes with (tfq.kernels.quant.FORMATS) as `Quantized` (its
    activations fp32, or q8 for weights: gguf-q8), the embedding as `BlockRows` on the file, anything else
    (F32, F16, other quantizations, vectors) dequantized to a float32 torch tensor, as `weights: fp32` has it."""
    from gguf.constants import GGMLQuantizationType

    from tfq.model.lazy import LazyTensors

    layouts = hf_layouts(h)
    names = {model_name(n, layouts.get(t.name)): t for n, t in tensor_names(h)}
    data = FileBytes(h.path)

    def read(name: str):
        import torch

        from tfq.kernels.quant import FORMATS, from_blocks

        t = names[name]
        kind = GGMLQuantizationType(t.ggml_type).name
        layout = layouts.get(t.name)
        if name == EMBEDDING and len(t.shape) == 2:
            return BlockRows(kind, data, t, activations)
        out = None
        if kind in FORMATS and len(t.shape) == 2:
            out = from_blocks(kind, data.of(t), t.shape).with_activations(activations)
            if layout is not None:  # value heads back in grouped order: whole rows, or whole groups of inputs
                out = out.select(torch.from_numpy(layout.rows)) if layout.rows is not None else out
                out = out.permute_inputs(torch.from_numpy(layout.cols)) if layout.cols is not None else out
        if out is None:  # fp32, or a matrix whose inputs cannot be reordered by whole groups: its exact values
            out = fp32_value(h, data, t, layout)
        data.release(t)
        return out

    return LazyTensors(list(names), read, norms_multiply=True)


@dataclass(frozen=True)
class KeptWeights:
    """What `weights: gguf` keeps of a file, from its header alone."""

    resident: int  # bytes the loaded model holds: every blob, fp32 tensors, and the embedding's file bytes
    step: int  # bytes a decode step at one lane reads of them (the embedding is a lookup unless the head shares
    # it; of a mixture, the chosen experts)
    fp32: int  # the same step in fp32
    embedding: int  # the embedding's bytes, left on the mapped file (resident as its rows are read)
    counts: dict  # matrices by how they are kept: their GGUF type, or "fp32"


def kept_summary(h: GgufHeader, activations: str = "fp32") -> KeptWeights:
    """The bytes `kept_tensors` and the model keep, counted as kernels/cpu/quant.cpp (quant_q8.cpp for activations
    q8) lays each matrix out (tfq.kernels.quant.kept_bytes, as `read` keeps it): what the plan's weights line says
    and its total counts."""
    from gguf.constants import GGMLQuantizationType

    from tfq.kernels.contract import PANEL
    from tfq.kernels.quant import KEPT, SUPER, Quantized, kept_bytes, kept_bytes_q8

    count = kept_bytes_q8 if activations == "q8" else kept_bytes

    counts: dict[str, int] = {}
    resident = step = fp32 = embedding = 0
    tied = not any(t.name == "output.weight" for t in h.tensors)
    layouts = hf_layouts(h)
    hybrid = bool(layouts)
    arch = h.metadata.get("general.architecture")
    for t in matrices(h):
        size = math.prod(t.shape)
        kind = GGMLQuantizationType(t.ggml_type).name
        kept = kind in KEPT and len(t.shape) == 2
        cols = layouts[t.name].cols if t.name in layouts else None
        if kept and cols is not None and not Quantized.inputs_movable(cols, KEPT[kind][1]):
            kept = False  # its inputs cannot be reordered by whole groups: kept in fp32
        if len(t.shape) == 2:
            counts[kind if kept else "fp32"] = counts.get(kind if kept else "fp32", 0) + 1
        matrix = 4 * size
        if len(t.shape) == 2 and not kept and t.name != "token_embd.weight" and "conv1d" not in t.name:
            matrix = 4 * -(-t.shape[0] // PANEL) * PANEL * t.shape[1]  # a linear layer's panels (a lone row: 64)
        if kept:
            n, k = t.shape
            whole = 0 if cols is not None else SUPER.get(kind, 0)  # reordered inputs give up the super blocks
            halves = 2 if hybrid and t.name.endswith("attn_q.weight") else 1  # queries and gates apart
            matrix = halves * count(*KEPT[kind], n // halves, k, whole)
        if t.name == "token_embd.weight":
            embedding = t.n_bytes if len(t.shape) == 2 else 4 * size
            resident += embedding
            if not tied:
                continue
            resident += matrix  # the head computes with the embedding's blocks, packed
        else:
            resident += matrix
        share = 1  # a row reads only its chosen experts
        if EXPERT_MATRIX.search(t.name):
            share = h.count(f"{arch}.expert_used_count") / h.count(f"{arch}.expert_count")
        fp32 += round(4 * size * share)
        step += round(matrix * share)
    return KeptWeights(resident, step, fp32, embedding, counts)
