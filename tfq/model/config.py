"""What tfq needs to know of a model's shape, read from an HF config.json (never from weights)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tfq.errors import TfqError

FAMILIES = {
    # model_type -> (q/k/v bias, q_norm and k_norm)
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen3_5": (False, True),  # hybrid: Gated DeltaNet layers between gated full attention layers
    "qwen3_moe": (False, True),  # Qwen3 with mixture-of-experts MLPs
    "qwen3_5_moe": (False, True),  # the hybrid with mixture-of-experts MLPs, a shared expert beside them
}
# config.json model_type of a Qwen3.5 checkpoint (text inside, or the text model's own) -> tfq's family
HYBRID_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                "qwen3_5_moe_text": "qwen3_5_moe"}
LAYER_TYPES = ("full_attention", "linear_attention")  # what a hybrid's layer_types may name


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes: per stream it keeps a recurrent state [value_heads, key_dim, value_dim]
    and the last conv_kernel - 1 inputs of its causal convolution over the q, k, v channels."""

    conv_kernel: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def channels(self) -> int:
        """The convolution's channels: queries, keys, values."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_floats(self) -> int:
        """fp32 numbers a stream keeps for one layer: the recurrent state and the convolution window."""
        return self.value_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.channels


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP's sizes: a router picks `chosen` of `experts` MLPs for each row, each of
    `intermediate` rows, and `sparse[i]` says whether layer i's MLP is one (else a dense MLP of the model's
    intermediate_size)."""

    experts: int
    chosen: int
    intermediate: int
    normalized: bool  # the chosen experts' weights divided by their sum (norm_topk_prob)
    sparse: tuple[bool, ...]
    shared_intermediate: int = 0  # Qwen3.5: an expert every row runs, gated by sigmoid (0: none)

    def expected_distinct(self, rows: int) -> float:
        """Experts a step of `rows` rows reads, on average, were the router's choices uniform."""
        return self.experts * (1 - (1 - self.chosen / self.experts) ** rows)


ROPE_TYPES = ("default", "linear", "yarn")  # what tfq computes, exactly as HF transformers does


@dataclass(frozen=True)
class RopeScaling:
    """A long-context checkpoint's rotary scaling (config.json `rope_scaling` or `rope_parameters`), resolved to
    the values the frequencies are computed from (tfq.model.rope), HF transformers' defaults filled in."""

    kind: str  # "linear" or "yarn"
    factor: float
    original_max_positions: int = 0  # yarn: the context the model was pretrained with
    attention_factor: float = 1.0  # yarn: multiplies cos and sin
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    weights_dtype: str  # as stored in the checkpoint ("bfloat16", "float32", ...)
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None  # None: plain rotary embedding
    layer_types: tuple[str, ...] = ()  # a hybrid's kind of each layer (LAYER_TYPES); () for all full attention
    partial_rotary: float = 1.0  # the share of each head's dimensions the rotary embedding turns
    deltanet: DeltaNetShape | None = None  # a hybrid's linear attention layers
    skipped: str = ""  # what of the checkpoint tfq does not run (a vision tower), for the plan's lines
    quantized: str = ""  # how an MLX checkpoint's weights are stored ("MLX 4-bit affine, groups of 64")
    moe: MoEShape | None = None  # mixture-of-experts MLPs

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts."""
        return [i for i, s in enumerate(self.moe.sparse) if s] if self.moe is not None else []

    @property
    def hybrid(self) -> bool:
        """Qwen3.5: DeltaNet layers with a recurrent state, gated attention, norms stored as 1 + weight."""
        return self.deltanet is not None

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "full_attention"]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "linear_attention"]

    @property
    def cache_index(self) -> list[int]:
        """Each layer's index among the cache's layers of its kind: attention layers hold keys and values, DeltaNet
        layers a state slot per stream."""
        attention, deltanet = self.attention_layers, self.deltanet_layers
        return [attention.index(i) if k == "full_attention" else deltanet.index(i) for i, k in enumerate(self.kinds)]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def state_bytes(self) -> int:
        """Bytes one stream's recurrent state and convolution windows take, in every DeltaNet layer (fp32)."""
        return 0 if self.deltanet is None else 4 * self.deltanet.state_floats * len(self.deltanet_layers)

    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family][0]

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family][1]

    @property
    def group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attention = h * q * (2 if self.hybrid else 1) + 2 * h * kv + q * h  # a hybrid's q_proj holds the gate
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * d
        total = len(self.attention_layers) * attention + self.num_layers * 2 * h
        total += (self.num_layers - len(self.moe_layers)) * 3 * h * i
        if self.moe is not None:
            total += len(self.moe_layers) * self.moe_params()
        if self.deltanet is not None:
            n = self.deltanet
            v = n.value_heads * n.value_dim
            linear = h * (n.channels + v + 2 * n.value_heads) + n.channels * n.conv_kernel + 2 * n.value_heads
            total += len(self.deltanet_layers) * (linear + n.value_dim + v * h)
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + total + h + head

    def moe_params(self, experts: int | None = None) -> int:
        """One mixture-of-experts MLP's parameters: the router and `experts` experts (all of them by default)."""
        m, h = self.moe, self.hidden_size
        shared = 3 * h * m.shared_intermediate + h if m.shared_intermediate else 0  # and its gate [1, hidden]
        return m.experts * h + (m.experts if experts is None else experts) * 3 * h * m.intermediate + shared

    def active_param_count(self) -> int:
        """The parameters one row's forward multiplies by: its chosen experts only (all of them without experts)."""
        if self.moe is None:
            return self.param_count()
        unchosen = self.moe_params() - self.moe_params(self.moe.chosen)
        return self.param_count() - len(self.moe_layers) * unchosen

    def read_params(self, lanes: int) -> float:
        """Parameters a decode step of `lanes` rows reads: all but an untied embedding (a lookup of a few rows) and,
        of a mixture, the experts no row chose (the distinct ones expected were the router's choices uniform)."""
        untied = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        m = self.moe
        unread = 0 if m is None else (m.experts - m.expected_distinct(lanes)) * 3 * self.hidden_size * m.intermediate
        return self.param_count() - untied - unread * len(self.moe_layers)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        family = raw.get("model_type")
        skipped = ""
        if family in HYBRID_TYPES:
            raw, skipped = _text_config(raw, where)
            family = HYBRID_TYPES[family]
        if family not in FAMILIES:
            raise TfqError(
                f"{where}: model_type {family!r} is not supported; tfq runs {', '.join(sorted(FAMILIES))} checkpoints"
            )
        _refuse_sliding_window(raw, where)
        try:
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads", heads))
            hidden = int(raw["hidden_size"])
            if heads < 1 or kv_heads < 1 or heads % kv_heads:
                raise TfqError(
                    f"{where}: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads "
                    f"({kv_heads}): every key/value head serves the same number of query heads; fix the config"
                )
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = raw.get("rope_theta")
            if rope is None:
                rope = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                # a Qwen3.5 MoE has no dense MLP: its shared expert's size stands in
                intermediate_size=int(raw["intermediate_size"] if "intermediate_size" in raw or family != "qwen3_5_moe"
                                      else raw["shared_expert_intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rope_theta=float(rope),
                rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_positions=int(raw.get("max_position_embeddings", 32768)),
                tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                weights_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                rope_scaling=_rope_scaling(raw, where),
                **(_hybrid_fields(raw, int(raw["num_hidden_layers"]), where, skipped)
                   if family in ("qwen3_5", "qwen3_5_moe") else {}),
                quantized=_quantized(raw, where),
                moe=_moe(raw, int(raw["num_hidden_layers"]), where) if family.endswith("_moe") else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TfqError(f"{where}: missing or malformed field {e}; is this a Qwen config.json?") from None

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise TfqError(f"{folder}: no config.json there; point --model at an HF checkpoint folder or a .gguf file")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TfqError(f"{path}: not readable JSON ({e})") from None
        return cls.from_dict(raw, str(path))


def _text_config(raw: dict, where: str) -> tuple[dict, str]:
    """A Qwen3.5 config's text model: the config itself (qwen3_5_text, qwen3_5_moe_text), or the text_config inside
    an image-and-text config, whose vision tower tfq skips; (text config, what is skipped)."""
    kind = raw.get("model_type")
    if kind.endswith("_text"):
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict) or "num_hidden_layers" not in text:
        raise TfqError(f"{where}: a {kind} config without a text_config: a vision-only checkpoint; tfq runs "
                       f"the text model, so point --model at a checkpoint that has one")
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(text)
    merged["model_type"] = kind + "_text"
    vision = raw.get("vision_config")
    depth = vision.get("depth") if isinstance(vision, dict) else None
    if not isinstance(vision, dict):
        return merged, ""
    return merged, (f"the vision tower ({depth} blocks)" if depth else "the vision tower")


def _hybrid_fields(raw: dict, layers: int, where: str, skipped: str) -> dict:
    """A Qwen3.5 text config's layer kinds, partial rotary and DeltaNet sizes (HF transformers' defaults)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        every = int(raw.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise TfqError(f"{where}: layer_types must list one kind per layer ({layers}), got {kinds!r}")
    unknown = sorted({str(k) for k in kinds} - set(LAYER_TYPES))
    if unknown:
        raise TfqError(f"{where}: layer type {unknown[0]!r} is not one tfq runs; a qwen3_5 layer is one of "
                       f"{', '.join(LAYER_TYPES)}: fix layer_types")
    rope = raw.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    shape = DeltaNetShape(int(raw.get("linear_conv_kernel_dim", 4)), int(raw.get("linear_num_key_heads", 16)),
                          int(raw.get("linear_key_head_dim", 128)), int(raw.get("linear_num_value_heads", 32)),
                          int(raw.get("linear_value_head_dim", 128)))
    if shape.value_heads % shape.key_heads or shape.conv_kernel < 1:
        raise TfqError(f"{where}: linear_num_value_heads ({shape.value_heads}) must be a multiple of "
                       f"linear_num_key_heads ({shape.key_heads}), and linear_conv_kernel_dim at least 1")
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    if not 0 < partial <= 1 or int(head_dim * partial) % 2:
        raise TfqError(f"{where}: partial_rotary_factor {partial} must leave an even number of rotary dimensions")
    return {"layer_types": tuple(kinds), "partial_rotary": partial, "deltanet": shape,
            "skipped": skipped}


def _moe(raw: dict, layers: int, where: str) -> MoEShape:
    """A mixture-of-experts config's experts (transformers' names; it writes num_local_experts), and which layers
    have them: every decoder_sparse_step-th layer not in mlp_only_layers, as transformers builds them. Qwen3.5's
    are in every layer, always normalized, with a shared expert."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    chosen = int(raw.get("num_experts_per_tok", 8))
    if not 0 < chosen <= experts:
        raise TfqError(f"{where}: num_experts_per_tok ({chosen}) must be between 1 and num_experts ({experts})")
    step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or ())
    if step < 1:
        raise TfqError(f"{where}: decoder_sparse_step must be at least 1, got {step}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    if raw.get("shared_expert_intermediate_size"):  # Qwen3.5 (its router always normalizes)
        return MoEShape(experts, chosen, int(raw["moe_intermediate_size"]), True, (True,) * layers,
                        int(raw["shared_expert_intermediate_size"]))
    return MoEShape(experts, chosen, int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False)), sparse)


def _quantized(raw: dict, where: str) -> str:
    from tfq.model.mlx import quantization

    quant = quantization(raw, where)
    return quant.words() if quant is not None else ""


def _refuse_sliding_window(raw: dict, where: str) -> None:
    """tfq attends to every earlier row; a sliding-window layer would be run wrong, so refuse it."""
    if raw.get("use_sliding_window"):
        why = "use_sliding_window: true"
    elif "sliding_attention" in (raw.get("layer_types") or ()):
        why = "layer_types has sliding_attention"
    else:
        return
    raise TfqError(f"{where}: sliding-window attention ({why}) is not supported; tfq runs full attention only: "
                   f"use a checkpoint without it")


def _rope_scaling(raw: dict, where: str) -> RopeScaling | None:
    """The checkpoint's rotary scaling, read as HF transformers reads it (`rope_scaling` wins over
    `rope_parameters`, `rope_type` over `type`); None for the plain rotary embedding."""
    spec = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if isinstance(spec, dict) and isinstance(spec.get("full_attention"), dict):
        spec = spec["full_attention"]  # per-layer-type parameters (transformers 5); sliding layers are refused
    if not isinstance(spec, dict):
        raise TfqError(f"{where}: rope_scaling must be a mapping such as {{\"rope_type\": \"yarn\", \"factor\": 4.0}}, "
                       f"not {spec!r}")
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return None
    if kind == "dynamic":
        raise TfqError(f"{where}: rope scaling type 'dynamic' is not supported: its frequencies change with the "
                       f"sequence length, so a row's bits would depend on the batch; tfq runs "
                       f"{', '.join(ROPE_TYPES)} (remove rope_scaling or use yarn)")
    if kind not in ROPE_TYPES:
        raise TfqError(f"{where}: rope scaling type {kind!r} is not supported; tfq runs {', '.join(ROPE_TYPES)}")
    max_positions = int(raw.get("max_position_embeddings", 32768))
    original = raw.get("original_max_position_embeddings") or spec.get("original_max_position_embeddings")
    original = int(original or max_positions)
    factor = spec.get("factor")
    if factor is None and kind == "yarn":
        factor = max_positions / original
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise TfqError(f"{where}: rope scaling factor must be a positive number, got {factor!r}")
    if kind == "linear":
        return RopeScaling("linear", float(factor))
    attention = spec.get("attention_factor")
    if attention is None:
        mscale, mscale_all = spec.get("mscale"), spec.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling("yarn", float(factor), original, float(attention), float(spec.get("beta_fast") or 32),
                       float(spec.get("beta_slow") or 1), bool(spec.get("truncate", True)))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (HF transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
