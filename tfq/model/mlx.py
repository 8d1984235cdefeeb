"""MLX checkpoints (mlx-lm's format): affine-quantized safetensors, dequantized exactly as MLX dequantizes.

A quantized linear layer (or embedding) `X` is three tensors: `X.weight`, uint32 words holding the integer
codes as one little-endian bit stream per row (`bits` each), and `X.scales` and `X.biases`, one of each per
group of `group_size` inputs; config.json says `quantization: {group_size, bits}` (a module's own entry
overrides them, `false` leaves it unquantized). A weight is

    w = round(round(q * scale) + bias)

computed in the scales' dtype (bf16, fp16 or fp32), each operation rounded to it: that is MLX's own
`mx.dequantize` (tests/test_mlx.py compares it bit for bit). tfq computes in fp32, so the dequantized weight is
widened to fp32, which is exact. MLX's layout differs from transformers' in two places that tfq reads back:
the text model of an image-and-text checkpoint sits under `language_model.`, and a Qwen3.5 hybrid's norms are
stored as the weight they multiply by (transformers stores weight - 1) and its convolution as [channels, taps, 1]
(tfq.model.qwen reads both layouts).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tfq.errors import TfqError
from tfq.kernels.quant import Quantized

BITS = (2, 3, 4, 5, 6, 8)  # the widths mlx-lm writes


@dataclass(frozen=True)
class MlxQuantization:
    group_size: int
    bits: int
    overrides: dict  # module path -> {"group_size", "bits"} or False (left unquantized)

    def of(self, module: str) -> tuple[int, int] | None:
        """(group size, bits) of a module's tensors, None if it is left unquantized."""
        spec = self.overrides.get(module, True)
        if spec is False:
            return None
        if isinstance(spec, dict):
            return int(spec.get("group_size", self.group_size)), int(spec.get("bits", self.bits))
        return self.group_size, self.bits

    def words(self) -> str:
        return f"MLX {self.bits}-bit affine, groups of {self.group_size}"


def quantization(raw: dict, where: str = "config.json") -> MlxQuantization | None:
    """The checkpoint's MLX quantization (config.json `quantization`), None for an unquantized checkpoint."""
    spec = raw.get("quantization")
    if spec is None:
        return None
    if not isinstance(spec, dict) or "bits" not in spec or "group_size" not in spec:
        raise TfqError(f"{where}: quantization must be a mapping with group_size and bits (an MLX checkpoint), "
                       f"got {spec!r}")
    mode = spec.get("mode", "affine")
    bits, group = spec["bits"], spec["group_size"]
    if mode != "affine" or bits not in BITS or not isinstance(group, int) or group < 1:
        raise TfqError(f"{where}: MLX quantization {mode} with {bits} bits in groups of {group} is not one tfq reads; "
                       f"it reads affine groups of {', '.join(map(str, BITS))} bits")
    overrides = {k: v for k, v in spec.items() if k not in ("group_size", "bits", "mode")}
    return MlxQuantization(group, bits, overrides)


def codes(packed: torch.Tensor, bits: int, inputs: int) -> torch.Tensor:
    """The integer codes [out, inputs] (int32) of uint32 words [out, words]: one little-endian bit stream a row."""
    words = packed.contiguous().view(torch.int32).numpy().view(np.uint32)
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        values = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    else:  # 3, 5, 6 bits: codes cross word boundaries
        stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
        stream = stream[..., :inputs * bits].reshape(*words.shape[:-1], inputs, bits).astype(np.uint32)
        values = (stream << np.arange(bits, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return torch.from_numpy(values.reshape(*words.shape[:-1], -1)[..., :inputs].astype(np.int32))


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """fp32 weights [out, in]: each code times its group's scale plus its bias, rounded to the scales' dtype
    after each operation, as MLX computes it."""
    inputs = scales.shape[-1] * group
    if packed.shape[-1] * 32 != inputs * bits:
        raise TfqError(f"MLX tensor of {packed.shape[-1]} words a row does not hold {inputs} {bits}-bit codes")
    q = codes(packed, bits, inputs).to(scales.dtype)
    s = scales.repeat_interleave(group, -1)
    b = biases.repeat_interleave(group, -1)
    return (q * s + b).float()  # torch rounds the product, then the sum, to the scales' dtype (MLX does the same)


KEPT_BITS = (4, 5, 6, 8)  # widths tfq's quantized kernel computes with (kernels/cpu/quant.cpp)
KEPT_GROUPS = (16, 32, 64, 128)
KEPT_SCALES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the roundings the kernel has (fp16's: not yet)


def keepable(quant: MlxQuantization) -> str:
    """Why the checkpoint's groups cannot be kept as they are (weights: mlx), or "" when they can."""
    if quant.bits not in KEPT_BITS:
        return f"tfq's quantized kernel computes with {', '.join(map(str, KEPT_BITS))} bits, not {quant.bits}"
    if quant.group_size not in KEPT_GROUPS:
        return f"tfq's quantized kernel takes groups of {', '.join(map(str, KEPT_GROUPS))}, not {quant.group_size}"
    return ""


def kept(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int, bits: int) -> Quantized | None:
    """The layer's groups as tfq's quantized kernel keeps them (codes, fp32 scales and biases, MLX's rounding),
    or None where the kernel cannot (other widths, groups, or fp16 scales: dequantize instead)."""
    rounding = KEPT_SCALES.get(scales.dtype)
    if rounding is None or bits not in KEPT_BITS or group not in KEPT_GROUPS or biases.dtype != scales.dtype:
        return None
    q = codes(packed, bits, scales.shape[-1] * group)
    zero = 0
    if bits == 8:  # the kernel reads 8-bit codes as signed bytes: code - 128, and zero -128 adds it back exactly
        q, zero = q - 128, -128
    return Quantized(q.to(torch.int8).view(torch.uint8) if bits == 8 else q.to(torch.uint8), scales.float(),
                     biases.float(), bits, group, zero, "MLX", rounding)


def load_mlx_state(folder: Path, quant: MlxQuantization, keep: bool = False) -> dict[str, torch.Tensor | Quantized]:
    """Every tensor of an MLX checkpoint by name, fp32, quantized ones dequantized (names without .scales and
    .biases), or with `keep` kept in their groups where tfq's quantized kernel computes with them (the same
    weights, bit for bit); tensors of what tfq does not run (a vision tower, multi-token prediction) are left
    out."""
    from safetensors import SafetensorError, safe_open

    from tfq.model.weights import safetensors_files

    raw: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if not name.startswith(("vision_tower.", "model.visual.", "mtp.", "language_model.vision")):
                        raw[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise TfqError(f"{path}: not a readable safetensors file ({e}); "
                           "it may be truncated, copy it again") from None
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in raw:
            spec = quant.of(module)
            if spec is None:
                raise TfqError(f"{folder}: {module} has scales but config.json leaves it unquantized")
            if module + ".biases" not in raw:
                raise TfqError(f"{folder}: {module} has scales but no biases; tfq reads MLX's affine groups")
            scales, biases = raw[module + ".scales"], raw[module + ".biases"]
            for part, (w, s, b) in _experts(name, (t, scales, biases)):
                groups = kept(w, s, b, *spec) if keep else None
                out[part] = groups if groups is not None else dequantize(w, s, b, *spec)
        else:
            for part, (w,) in _experts(name, (t,)):
                out[part] = w if w.dtype == torch.float32 else w.to(torch.float32)
    return out


def _experts(name: str, tensors: tuple):
    """(name, tensors) of a matrix; a mixture's experts stacked by mlx-lm (mlp.switch_mlp.X [experts, ...]) as
    one matrix an expert under transformers' names (mlp.experts.E.X)."""
    if ".switch_mlp." not in name or tensors[0].dim() != 3:
        return [(name, tensors)]
    return [(name.replace(".switch_mlp.", f".experts.{e}."), tuple(t[e] for t in tensors))
            for e in range(tensors[0].shape[0])]


def folder_quantization(folder: Path) -> MlxQuantization | None:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return quantization(raw, str(path))
