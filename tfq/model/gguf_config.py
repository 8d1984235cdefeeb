"""The HF config.json of a GGUF file, from its metadata: the model's shape, and rope scaling as llama.cpp's
converter writes it."""
from __future__ import annotations

from typing import Any

import numpy as np

from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.model.gguf_header import GgufHeader

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}


def _float32_repr(v: float) -> float:
    """GGUF stores floats as f32; write the shortest decimal that round-trips (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def hf_config(h: GgufHeader) -> dict:
    """The HF config.json a conversion of this file writes."""
    md = h.metadata
    arch = md.get("general.architecture")
    if arch not in FAMILIES:
        raise TfqError(
            f"{h.path}: GGUF architecture {arch!r} is not supported; tfq runs {', '.join(sorted(FAMILIES))} models"
        )

    def key(name: str, default=None):
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise TfqError(f"{h.path}: GGUF metadata lacks {arch}.{name}; the file is not a complete {arch} model")
        return v

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    q = h.tensor("blk.0.attn_q.weight")
    head_dim = md.get(f"{arch}.attention.key_length") or (q.dims[1] // heads if q else hidden // heads)
    tokens = md.get("tokenizer.ggml.tokens")
    embd = h.tensor("token_embd.weight")
    vocab = len(tokens) if tokens is not None else (embd.dims[1] if embd else None)
    if vocab is None:
        raise TfqError(f"{h.path}: GGUF file has neither a vocabulary nor token_embd.weight")
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [FAMILIES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(key("context_length", 32768)),
        "rope_theta": _float32_repr(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32_repr(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "tie_word_embeddings": h.tensor("output.weight") is None,
        "torch_dtype": "float32",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    if arch != "qwen35moe":  # a Qwen3.5 mixture has no dense MLP
        config["intermediate_size"] = int(key("feed_forward_length"))
    if arch != "qwen2":
        config["attention_bias"] = False
    if arch in ("qwen35", "qwen35moe"):
        config.update(_hybrid_config(h, arch, key, int(head_dim)))
    if arch.endswith("moe"):
        config.update(_moe_config(arch, key))
    scaling = _rope_scaling(h, arch)
    if scaling:
        config["rope_scaling"] = scaling
    ModelConfig.from_dict(config, str(h.path))  # refuse here what the converted folder would be refused for
    return config


def _moe_config(arch: str, key) -> dict:
    """A mixture's sizes from llama.cpp's keys. llama.cpp normalizes the chosen experts' weights for both
    families (norm_topk_prob), so the file's model is that one."""
    config = {"num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
              "moe_intermediate_size": int(key("expert_feed_forward_length")), "norm_topk_prob": True}
    if arch == "qwen35moe":
        config["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return config


def _hybrid_config(h: GgufHeader, arch: str, key, head_dim: int) -> dict:
    """A qwen35 file's Qwen3.5 text config: the layer kinds, the DeltaNet sizes and the partial rotary, from the
    keys llama.cpp's converter writes (ssm.group_count: key heads, ssm.time_step_rank: value heads,
    ssm.state_size: a key head's dims, ssm.inner_size: all value dims)."""
    layers = int(key("block_count"))
    recurrent = h.metadata.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        every = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    value_heads = int(key("ssm.time_step_rank"))
    sections = [int(x) for x in h.metadata.get(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])]
    while len(sections) > 3 and sections[-1] == 0:
        sections.pop()
    rotary = int(key("rope.dimension_count", head_dim // 4))
    return {
        "model_type": MODEL_TYPES[arch],
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": _float32_repr(key("rope.freq_base", 10000.0)),
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
    out: dict[str, Any] = {"rope_type": kind, "factor": _float32_repr(md.pop("factor"))}
    if kind == "yarn":
        if "original_context_length" in md:
            out["original_max_position_embeddings"] = int(md.pop("original_context_length"))
        for key in ("beta_fast", "beta_slow"):
            if f"yarn_{key}" in md:
                out[key] = _float32_repr(md.pop(f"yarn_{key}"))
    for key, value in md.items():
        if value not in _NEUTRAL_SCALING.get(key, ()):
            raise TfqError(f"{h.path}: GGUF metadata {prefix}{key} = {value!r} is not supported; tfq computes "
                           f"{kind} rope scaling from type, factor and original_context_length only")
    return out
