"""What a loaded model holds in memory, counted before loading: the weights as the plan's `weights` keeps them
(a GGUF's blobs from its header alone; which kind: weights_kind), and the activations of the largest forward."""
from __future__ import annotations

from pathlib import Path

import torch

from tfq.errors import TfqError
from tfq.model.config import ModelConfig

# torch, tfq's kernels, the tokenizer and Python itself: resident memory that no plan setting moves (measured
# here: 220 MiB for torch and the kernels, the default model's tokenizer 70 MiB more; a 250k-token vocabulary more)
FIXED_OVERHEAD = 500 * 2**20
KEPT_GGUF = ("gguf", "gguf-q8")  # weights that keep a GGUF file's blocks (activations fp32, or q8)
DEFAULT_GGUF = "gguf-q8"  # what weights: auto computes a GGUF file with (weights_kind says why)


def weight_bytes(spec: str, choice: str, config: ModelConfig, device: str = "cpu") -> int:
    """Bytes the model's weights take once loaded: a GGUF's matrices as their blobs (weights: gguf), an MLX
    checkpoint's groups (weights: mlx), else every parameter in fp32."""

    kind = weights_kind(choice, spec, device)[0]
    if kind in KEPT_GGUF:
        kept = gguf_kept(spec, activations_of(kind))
        if kept is not None:
            return kept.resident
    if kind == "mlx":
        from tfq.kernels.quant import kept_bytes
        from tfq.model.mlx import folder_quantization

        quant = folder_quantization(Path(spec).expanduser())
        if quant is not None:  # matrices as blobs; the embedding's groups with one byte a code (Quantized)
            h, v = config.hidden_size, config.vocab_size
            matrices = config.param_count() - v * h * (1 if config.tie_embeddings else 2)
            blob = kept_bytes(quant.bits, quant.group_size, True, matrices, 1) + kept_bytes(
                quant.bits, quant.group_size, True, v, h)
            return blob + v * h + 8 * v * h // quant.group_size
    return config.param_count() * 4


def gguf_kept(spec: str, activations: str = "fp32"):
    """kept_summary of the model's GGUF header (the default model's parts are joined first), or None for a
    folder."""
    from tfq.model.gguf_header import read_header
    from tfq.model.gguf_kept import kept_summary
    from tfq.model.source import gguf_path

    path = gguf_path(spec, progress=False)
    return None if path is None else kept_summary(read_header(path), activations)


def activation_row_bytes(config: ModelConfig) -> int:
    """Bytes one row of a forward holds at once at most, in fp32: the residual stream and a norm's output, the
    attention's projections and output (or a DeltaNet layer's), and the MLP's gate and up with their product."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim * (2 if c.hybrid else 1), c.num_kv_heads * c.head_dim
    mixer = 2 * q_out + 2 * kv_out
    if c.hybrid and c.deltanet is not None:
        n = c.deltanet
        mixer = max(mixer, 2 * (n.channels + n.value_heads * n.value_dim) + 2 * n.value_heads)
    return 4 * (3 * c.hidden_size + max(mixer, 3 * c.intermediate_size))


def weights_kind(choice: str, spec: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """(fp32 | gguf-q8 | mlx, why) for the plan's `weights` choice: auto is gguf-q8 for a GGUF model (the default
    one, or a .gguf file) and mlx for an MLX-quantized folder whose groups the kernel computes with, on tfq's CPU
    kernels, else fp32; a choice other than auto is taken as it is (its own checks come when the model loads).

    Why gguf-q8 and not gguf for a GGUF file: both are exact by tfq's rule (the same bits alone or together, at any
    thread count, on every CPU), and gguf-q8 is the faster at one lane by a wide margin (docs/quantized.md, "The
    default arithmetic"): gguf's fp32 sums, the dequantized model's bits, cost two fused multiply-adds a weight,
    while gguf-q8 sums 8-bit integers as llama.cpp does. `weights: gguf` is one key away."""
    if choice != "auto":
        return choice, "as the plan says"
    kind, why = DEFAULT_GGUF, "the model is a GGUF file"
    if spec != "default" and not (Path(spec).expanduser().is_file() and spec.endswith(".gguf")):
        from tfq.model.mlx import folder_quantization, keepable

        try:
            quant = folder_quantization(Path(spec).expanduser())
        except TfqError:
            quant = None  # the config's own error comes when it is read
        if quant is None:
            return "fp32", "the model is an HF folder"
        why_not = keepable(quant)
        if why_not:
            return "fp32", f"an MLX checkpoint dequantized: {why_not}"
        kind, why = "mlx", f"the model is an MLX checkpoint: {quant.words()}"
    if torch.device(device).type != "cpu":
        return "fp32", "tfq's quantized kernel runs on the CPU"
    from tfq.kernels import cpu_build

    try:
        if cpu_build.choice() == "torch":
            return "fp32", "TFQ_CPU_KERNELS=torch: tfq's CPU kernels are not in use"
    except ValueError:  # a bad TFQ_CPU_KERNELS: backend_for says so in its own words
        return "fp32", "TFQ_CPU_KERNELS is not a choice tfq knows"
    return kind, why  # if the kernels fail to build, load_model falls back to fp32


def activations_of(weights: str) -> str:
    """How a kept GGUF model's activations enter its quantized layers: q8 for weights: gguf-q8, else fp32."""
    return "q8" if weights == "gguf-q8" else "fp32"
