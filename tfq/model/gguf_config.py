"""The HF config.json of a GGUF file, from its metadata: the model's shape, and rope scaling as llama.cpp's
converter writes it."""
from __future__ import annotations

from typing import Any

import numpy as np

from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.model.gguf_header import GgufHeader, TensorInfo

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}


def _float32_repr(v: float) -> float:
    """GGUF stores floats as f32; write the shortest decimal that round-trips (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def hf_config(h: GgufHeader) -> dict:
    """The HF config.json a conversion of this file writes; every number read is checked (`GgufHeader.count`,
    `_real`), and the layers against the tensors, so no crafted value loops, divides by 0 or raises past here."""
    md = h.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise TfqError(
            f"{h.path}: GGUF architecture {arch!r:.40} is not supported; tfq runs {', '.join(sorted(FAMILIES))} models"
        )

    def key(name: str, default=None):
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise TfqError(f"{h.path}: GGUF metadata lacks {arch}.{name}; the file is not a complete {arch} model")
        return v

    def count(name: str, default: int | None = None, least: int = 1) -> int:
        key(name, default)  # its own message when missing
        return h.count(f"{arch}.{name}", default, least)

    def real(name: str, default: float | None = None) -> float:
        return _real(h, f"{arch}.{name}", key(name, default))

    heads = count("attention.head_count")
    hidden = count("embedding_length")
    layers = _block_count(h, count("block_count"))
    q = _tensor(h, "blk.0.attn_q.weight")
    head_dim = count("attention.key_length", q.dims[1] // heads if q else hidden // heads)
    vocab = _vocab(h)
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [FAMILIES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": count("context_length", 32768),
        "rope_theta": real("rope.freq_base", 10000.0),
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon", 1e-6),
        "hidden_act": "silu",
        "tie_word_embeddings": h.tensor("output.weight") is None,
        "torch_dtype": "float32",
        "bos_token_id": None if bos is None else h.count("tokenizer.ggml.bos_token_id", least=0),
        "eos_token_id": None if eos is None else h.count("tokenizer.ggml.eos_token_id", least=0),
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    if arch != "qwen35moe":  # a Qwen3.5 mixture has no dense MLP
        config["intermediate_size"] = count("feed_forward_length")
    if arch != "qwen2":
        config["attention_bias"] = False
    if arch in ("qwen35", "qwen35moe"):
        config.update(_hybrid_config(h, arch, count, real, layers, head_dim))
    if arch.endswith("moe"):
        config.update(_moe_config(arch, count))
    scaling = _rope_scaling(h, arch)
    if scaling:
        config["rope_scaling"] = scaling
    ModelConfig.from_dict(config, str(h.path))  # refuse here what the converted folder would be refused for
    return config


# More layers than any model has (llama.cpp's LLAMA_MAX_LAYERS is 512): the config builds a list a layer.
MAX_BLOCKS = 4096


def _block_count(h: GgufHeader, layers: int) -> int:
    """block_count, refused past the tensors the file has (every layer has some) or MAX_BLOCKS."""
    arch = h.metadata["general.architecture"]
    if layers > min(len(h.tensors), MAX_BLOCKS):
        raise TfqError(f"{h.path}: GGUF metadata {arch}.block_count = {layers:,} is more layers than the file's "
                       f"{len(h.tensors)} tensors hold (or past {MAX_BLOCKS}); the file is damaged")
    return layers


def _tensor(h: GgufHeader, name: str, n_dims: int = 2) -> TensorInfo | None:
    """The tensor `name`, refused unless it has `n_dims` dims (its second tells a size)."""
    t = h.tensor(name)
    if t is not None and len(t.dims) != n_dims:
        raise TfqError(f"{h.path}: tensor {name} has dims {t.dims}; it must have {n_dims}: the file is damaged")
    return t


def _vocab(h: GgufHeader) -> int:
    """The vocabulary's size: its token list's, else the embedding's rows."""
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list) and tokens):
        raise TfqError(f"{h.path}: GGUF metadata tokenizer.ggml.tokens is not a list of tokens; the file is damaged")
    embd = _tensor(h, "token_embd.weight")
    if tokens is None and embd is None:
        raise TfqError(f"{h.path}: GGUF file has neither a vocabulary nor token_embd.weight")
    return len(tokens) if tokens is not None else embd.dims[1]


def _real(h: GgufHeader, name: str, v) -> float:
    """A positive number from the metadata (a rope base, an epsilon, a scaling factor), finite in float32."""
    number = not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= _FLOAT32_MAX
    if not number or _float32_repr(v) == 0:
        raise TfqError(f"{h.path}: GGUF metadata {name} = {v!r:.40} is not a positive float32 number; the file is "
                       f"damaged")
    return _float32_repr(v)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _moe_config(arch: str, count) -> dict:
    """A mixture's sizes from llama.cpp's keys. llama.cpp normalizes the chosen experts' weights for both
    families (norm_topk_prob), so the file's model is that one."""
    config = {"num_experts": count("expert_count"), "num_experts_per_tok": count("expert_used_count"),
              "moe_intermediate_size": count("expert_feed_forward_length"), "norm_topk_prob": True}
    if arch == "qwen35moe":
        config["shared_expert_intermediate_size"] = count("expert_shared_feed_forward_length")
    return config


def _hybrid_config(h: GgufHeader, arch: str, count, real, layers: int, head_dim: int) -> dict:
    """A qwen35 file's Qwen3.5 text config: the layer kinds, the DeltaNet sizes and the partial rotary, from the
    keys llama.cpp's converter writes (ssm.group_count: key heads, ssm.time_step_rank: value heads,
    ssm.state_size: a key head's dims, ssm.inner_size: all value dims)."""
    recurrent = h.metadata.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        every = count("full_attention_interval", 4)
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    value_heads = count("ssm.time_step_rank")
    sections = h.metadata.get(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    if not isinstance(recurrent, list) or not isinstance(sections, list) or not all(
            isinstance(x, int) for x in sections):
        raise TfqError(f"{h.path}: GGUF metadata {arch}.attention.recurrent_layers or {arch}.rope.dimension_sections "
                       f"is not a list of integers; the file is damaged")
    sections = list(sections)
    while len(sections) > 3 and sections[-1] == 0:
        sections.pop()
    rotary = count("rope.dimension_count", head_dim // 4)
    return {
        "model_type": MODEL_TYPES[arch],
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_conv_kernel_dim": count("ssm.conv_kernel"),
        "linear_key_head_dim": count("ssm.state_size"),
        "linear_num_key_heads": count("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": count("ssm.inner_size") // value_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": real("rope.freq_base", 10000.0),
                            "partial_rotary_factor": rotary / head_dim, "mrope_section": sections,
                            "mrope_interleaved": True},
    }


# llama.cpp's rope.scaling keys that tfq does not compute, and their values that change nothing.
_NEUTRAL_SCALING = {"attn_factor": (1.0,), "yarn_log_multiplier": (0.0,), "yarn_ext_factor": (-1.0, 1.0),
                    "yarn_attn_factor": (1.0,), "finetuned": (True, False)}


def _rope_scaling(h: GgufHeader, arch: str) -> dict | None:
    """config.json's rope_scaling of a file written by llama.cpp's converter (`{arch}.rope.scaling.*`), or None.

    The converter writes type, factor and original_context_length for a yarn or linear checkpoint. Read as
    llama.cpp reads them: no type means linear, type none or a linear factor of 0 means no scaling. A key tfq
    would have to guess the meaning of is refused rather than dropped (dropping it runs the model wrong)."""
    prefix = f"{arch}.rope.scaling."
    md = {k[len(prefix):]: v for k, v in h.metadata.items() if k.startswith(prefix)}
    if "factor" not in md and f"{arch}.rope.scale_linear" in h.metadata:
        md["factor"] = h.metadata[f"{arch}.rope.scale_linear"]  # the key's older name
    kind = md.pop("type", "linear")
    if kind == "none" or (kind == "linear" and not md.get("factor")):
        return None
    if kind not in ("linear", "yarn"):
        raise TfqError(f"{h.path}: GGUF {prefix}type {kind!r} is not supported; tfq runs none, linear and yarn "
                       f"rope scaling")
    if not md.get("factor"):
        raise TfqError(f"{h.path}: GGUF {prefix}type is yarn but {prefix}factor is missing or 0; "
                       f"the file is incomplete: convert the checkpoint again")
    out: dict[str, Any] = {"rope_type": kind, "factor": _real(h, f"{prefix}factor", md.pop("factor"))}
    if kind == "yarn":
        if "original_context_length" in md:
            md.pop("original_context_length")
            out["original_max_position_embeddings"] = h.count(f"{prefix}original_context_length")
        for key in ("beta_fast", "beta_slow"):
            if f"yarn_{key}" in md:
                out[key] = _real(h, f"{prefix}yarn_{key}", md.pop(f"yarn_{key}"))
    for key, value in md.items():
        if value not in _NEUTRAL_SCALING.get(key, ()):
            raise TfqError(f"{h.path}: GGUF metadata {prefix}{key} = {value!r} is not supported; tfq computes "
                           f"{kind} rope scaling from type, factor and original_context_length only")
    return out
