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
}


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
        layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            layer += q + 2 * kv
        if self.qk_norm:
            layer += 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        family = raw.get("model_type")
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
                intermediate_size=int(raw["intermediate_size"]),
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
