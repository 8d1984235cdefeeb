"""A GGUF file's tensors as HF parameters: llama.cpp's tensor names mapped to HF's, each tensor dequantized
to float32 (by `gguf.quants.dequantize`) in its row-major shape, or, for `weights: gguf`, the quantized
matrices kept in their blocks (`kept_tensors`)."""
from __future__ import annotations

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


def kept_tensors(h: GgufHeader) -> dict[str, object]:
    """Every tensor by its HF name: a matrix in a format tfq's quantized kernel computes with
    (tfq.kernels.quant.FORMATS) as `Quantized`, anything else (F32, F16, other quantizations, vectors)
    dequantized to a float32 torch tensor, as `weights: fp32` has it."""
    import torch
    from gguf.constants import GGMLQuantizationType

    from tfq.kernels.quant import FORMATS, from_blocks

    data = np.memmap(h.path, dtype=np.uint8, mode="r")
    out: dict[str, object] = {}
    for name, t in tensor_names(h):
        kind = GGMLQuantizationType(t.ggml_type).name
        if kind in FORMATS and len(t.shape) == 2:
            out[name] = from_blocks(kind, data[t.offset:t.offset + t.n_bytes], t.shape)
        else:
            out[name] = torch.from_numpy(np.array(dequantized(h, data, t)))
    return out


def kept_summary(h: GgufHeader) -> tuple[dict[str, int], int, int]:
    """What `weights: gguf` keeps of this file, from its header alone: (matrices by type, those tfq does not
    compute with counted as "fp32"), the bytes a decode step reads of the weights kept so, and in fp32.
    The embedding is a lookup unless the head shares it."""
    from gguf.constants import GGMLQuantizationType

    from tfq.kernels.quant import KEPT, kept_bytes

    counts: dict[str, int] = {}
    step = fp32 = 0
    tied = not any(t.name == "output.weight" for t in h.tensors)
    for t in h.tensors:
        size = int(np.prod(t.shape, dtype=np.int64))
        kind = GGMLQuantizationType(t.ggml_type).name
        kept = kind in KEPT and len(t.shape) == 2
        if len(t.shape) == 2:
            counts[kind if kept else "fp32"] = counts.get(kind if kept else "fp32", 0) + 1
        if t.name == "token_embd.weight" and not tied:
            continue
        fp32 += 4 * size
        step += kept_bytes(*KEPT[kind], *t.shape) if kept else 4 * size
    return counts, step, fp32
