"""A GGUF file's tensors as HF parameters: llama.cpp's tensor names mapped to HF's, each tensor dequantized
to float32 (by `gguf.quants.dequantize`) in its row-major shape (for `weights: gguf`, the quantized matrices
kept in their blocks: tfq/model/gguf_kept.py). A mixture's experts, stacked in one tensor a layer in the file,
are one matrix an expert here, as in an HF checkpoint (`matrices`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
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
    # a mixture of experts (qwen3moe, qwen35moe): the router, and Qwen3.5's shared expert and its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
EXPERT_MATRIX = re.compile(r"ffn_(gate|up|down)_exps\.(\d+)\.weight")  # one expert's matrix (`matrices`)
HYBRID_ARCHS = ("qwen35", "qwen35moe")
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# qwen35 (Qwen3.5 hybrids, as llama.cpp's converter writes them): the DeltaNet layers' tensors, and the norm after
# attention under its own name
_HYBRID_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",  # stored as A = -exp(A_log): tfq takes it as linear_attn.A (`model_name`)
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}


def hf_name(name: str, hybrid: bool = False) -> str:
    """The HF parameter name of a GGUF tensor name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    names = {**_LAYER_NAMES, **_HYBRID_NAMES} if hybrid else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
        expert = EXPERT_MATRIX.fullmatch(parts[2])
        if expert:
            return f"model.layers.{parts[1]}.mlp.experts.{expert[2]}.{expert[1]}_proj.weight"
    raise KeyError(name)


def matrices(h: GgufHeader) -> list[TensorInfo]:
    """The file's tensors, a mixture's stacked experts (blk.N.ffn_gate_exps.weight [experts, out, in]) cut into
    one matrix an expert (blk.N.ffn_gate_exps.E.weight): each expert's blocks lie together in the file."""
    out = []
    for t in h.tensors:
        if len(t.dims) == 3 and t.name.endswith("_exps.weight"):
            _check_experts(h, t)
            per = t.n_bytes // t.dims[2]
            out += [TensorInfo(f"{t.name[:-len('weight')]}{e}.weight", t.dims[:2], t.ggml_type, t.offset + e * per,
                               per) for e in range(t.dims[2])]
        else:
            out.append(t)
    return out


# More experts than any model has (llama.cpp's LLAMA_MAX_EXPERTS is 512): `matrices` builds a record an expert.
MAX_EXPERTS = 4096


def _check_experts(h: GgufHeader, t: TensorInfo) -> None:
    """A stacked experts tensor holds expert_count experts, at most MAX_EXPERTS: a crafted last dim must not
    stand for billions of records (the header has checked that its bytes lie in the file, not that they are few)."""
    key = f"{h.metadata.get('general.architecture')}.expert_count"
    experts = h.count(key)
    if t.dims[2] != experts or experts > MAX_EXPERTS:
        raise TfqError(f"{h.path}: tensor {t.name} stacks {t.dims[2]:,} experts but {key} is {experts:,} "
                       f"(at most {MAX_EXPERTS} are read); the file is damaged: download or convert it again")


def tensor_names(h: GgufHeader) -> list[tuple[str, TensorInfo]]:
    """(HF name, tensor) for every tensor (every expert's own), in HF name order; TfqError on a tensor tfq does
    not know."""
    hybrid = h.metadata.get("general.architecture") in HYBRID_ARCHS
    out = []
    for t in matrices(h):
        try:
            out.append((hf_name(t.name, hybrid), t))
        except KeyError:
            raise TfqError(f"{h.path}: unexpected tensor {t.name!r}; tfq reads qwen2, qwen3, qwen3moe, qwen35 and "
                           f"qwen35moe GGUF files") from None
    return sorted(out, key=lambda p: p[0])


@dataclass(frozen=True)
class HfLayout:
    """How a qwen35 tensor of llama.cpp's converter goes back to transformers' layout. The converter stores a
    norm as the 1 + w it multiplies by, A as -exp(A_log), the convolution squeezed, and, when key and value
    heads differ in number, the value heads in tiled order (k0 k1 .. k0 k1) instead of grouped by key head."""

    rows: np.ndarray | None = None  # the HF row order: row i of the HF tensor is the file's row rows[i]
    cols: np.ndarray | None = None  # the same for the inputs (out_proj)
    norm: bool = False  # stored as 1 + w, computed in fp32 as transformers computes the multiplier: tfq keeps
    # it as it is (the multiplier's bits); a folder for transformers gets stored - 1, which may round
    a_log: bool = False  # stored as A = -exp(A_log): tfq computes with A; a folder for transformers gets log(-A)
    shape: tuple[int, ...] | None = None  # the HF shape (the convolution's [C, 1, K])

    def values(self, w: np.ndarray, folder: bool = False) -> np.ndarray:
        """An fp32 tensor of the file in transformers' layout (`folder`: as a checkpoint folder stores it, norms
        as w; else norms as the multiplier 1 + w, which tfq computes with)."""
        if self.rows is not None:
            w = w[self.rows]
        if self.cols is not None:
            w = w[:, self.cols]
        if self.norm and folder:
            w = w - np.float32(1)
        if self.a_log and folder:
            w = np.log(-w)
        return np.array(w.reshape(self.shape) if self.shape else w, dtype=np.float32)  # a copy: off the file


def hf_layouts(h: GgufHeader) -> dict[str, HfLayout]:
    """By GGUF tensor name, the ones a qwen35 (or qwen35moe) file stores otherwise than transformers does."""
    arch = h.metadata.get("general.architecture")
    if arch not in HYBRID_ARCHS:
        return {}
    nk, nv = h.count(f"{arch}.ssm.group_count"), h.count(f"{arch}.ssm.time_step_rank")
    kd, vd = h.count(f"{arch}.ssm.state_size"), h.count(f"{arch}.ssm.inner_size") // nv
    if nv % nk:
        raise TfqError(f"{h.path}: GGUF metadata {arch}.ssm.time_step_rank ({nv}) is not a multiple of "
                       f"{arch}.ssm.group_count ({nk}); the file is damaged")

    def grouped(head: int) -> np.ndarray | None:  # tiled -> grouped, for value heads of `head` dims
        if nk == nv:
            return None
        tiled = np.arange(nv * head).reshape(nk, nv // nk, head).transpose(1, 0, 2).reshape(-1)
        return np.argsort(tiled)

    def after_qk(head: int) -> np.ndarray | None:
        v = grouped(head)
        return None if v is None else np.concatenate([np.arange(2 * nk * kd), 2 * nk * kd + v])

    # part: (its HF layout, given the value heads' orders, and how many rows or inputs (axis) it reorders)
    qkv = 2 * nk * kd + nv * vd
    parts = {"attn_qkv.weight": (lambda t: HfLayout(rows=after_qk(vd)), 0, qkv),
             "attn_gate.weight": (lambda t: HfLayout(rows=grouped(vd)), 0, nv * vd),
             "ssm_beta.weight": (lambda t: HfLayout(rows=grouped(1)), 0, nv),
             "ssm_alpha.weight": (lambda t: HfLayout(rows=grouped(1)), 0, nv),
             "ssm_dt.bias": (lambda t: HfLayout(rows=grouped(1)), 0, nv),
             "ssm_a": (lambda t: HfLayout(rows=grouped(1), a_log=True), 0, nv),
             "ssm_conv1d.weight": (lambda t: HfLayout(rows=after_qk(vd), shape=(t.shape[0], 1, t.shape[-1])), 0,
                                   qkv),
             "ssm_out.weight": (lambda t: HfLayout(cols=grouped(vd)), 1, nv * vd)}
    out = {}
    for t in h.tensors:
        part = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        if part.endswith("norm.weight") and part != "ssm_norm.weight":
            out[t.name] = HfLayout(norm=True)
        elif part in parts:
            layout, axis, size = parts[part]
            _check_reordered(h, t, axis, size)  # before any order is built from the metadata's sizes
            out[t.name] = layout(t)
    return out


def _check_reordered(h: GgufHeader, t: TensorInfo, axis: int, size: int) -> None:
    """The tensor's rows (axis 0) or inputs (1) number `size`, as the metadata's DeltaNet sizes say."""
    if axis >= len(t.shape) or t.shape[axis] != size:
        raise TfqError(f"{h.path}: tensor {t.name} has shape {t.shape}, but the file's ssm.* sizes give it "
                       f"{size:,} {'rows' if axis == 0 else 'inputs'}; the file is damaged")


def model_name(name: str, layout: HfLayout | None) -> str:
    """The name tfq's model takes a tensor by: its HF name, but A (not A_log) for a file that stores A."""
    return name[:-len("A_log")] + "A" if layout is not None and layout.a_log else name


def hf_shape(t: TensorInfo, layout: HfLayout | None) -> tuple[int, ...]:
    return layout.shape if layout is not None and layout.shape else t.shape


def dequantized(path: Path, data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """One tensor of the GGUF file at `path` as float32, in its row-major shape."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.ggml_type)
    rows = t.shape[:-1]
    raw = data[t.offset:t.offset + t.n_bytes].reshape(*rows, t.n_bytes // math.prod(rows))
    try:
        out = dequantize(raw, qtype)
    except NotImplementedError:
        raise TfqError(f"{path}: tensor {t.name} is {qtype.name}, which the gguf package cannot dequantize") from None
    out = np.asarray(out, dtype=np.float32).reshape(t.shape)
    return out


def iter_tensors(h: GgufHeader) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array as a checkpoint folder stores it) in HF name order, one dequantized at a time."""
    names = tensor_names(h)
    layouts = hf_layouts(h)
    data = FileBytes(h.path)
    for name, t in names:
        w = dequantized(h.path, data.data, t)
        yield name, layouts[t.name].values(w, folder=True) if t.name in layouts else w
        data.release(t)


def fp32_tensors(h: GgufHeader):
    """Every tensor by its HF name, dequantized to fp32 when the model takes it (weights: fp32 on a GGUF file,
    with no fp32 copy on disk): LazyTensors whose norms are the multipliers (`norms_multiply`)."""
    from tfq.model.lazy import LazyTensors

    layouts = hf_layouts(h)
    names = {model_name(n, layouts.get(t.name)): t for n, t in tensor_names(h)}
    data = FileBytes(h.path)

    def read(name: str):
        t = names[name]
        out = fp32_value(h, data, t, layouts.get(t.name))
        data.release(t)
        return out

    return LazyTensors(list(names), read, norms_multiply=True)


def fp32_value(h: GgufHeader, data: "FileBytes", t: TensorInfo, layout: "HfLayout | None"):
    """One tensor dequantized to a float32 torch tensor, in tfq's layout (norms as their multipliers), off the file."""
    import torch

    w = dequantized(h.path, data.data, t)
    return torch.from_numpy(layout.values(w) if layout is not None else np.array(w))


class FileBytes:
    """A GGUF file mapped read-only: each tensor's bytes as a numpy view, and its pages let go once read (the
    file's pages would otherwise count in the process's resident memory beside the kept copy)."""

    def __init__(self, path):
        import mmap

        self.path = Path(path)
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
