"""What tfq needs to know of a model's shape, read from an HF config.json (never from weights)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tfq.errors import TfqError

FAMILIES = {
    # model_type -> (q/k/v bias, q_norm and k_norm)
    "qwen2": (True, False),
    "qwen3": (False, True),
}


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
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
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
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rope_theta=float(rope),
                rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_positions=int(raw.get("max_position_embeddings", 32768)),
                tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                weights_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
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
