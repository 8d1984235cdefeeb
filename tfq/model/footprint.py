"""What a loaded model holds in memory, counted before loading: the weights as the plan's `weights` keeps them
(a GGUF's blobs from its header alone), and the activations of the largest forward."""
from __future__ import annotations

from pathlib import Path

from tfq.model.config import ModelConfig

# torch, tfq's kernels, the tokenizer and Python itself: resident memory that no plan setting moves (measured
# here: 220 MiB for torch and the kernels, the default model's tokenizer 70 MiB more; a 250k-token vocabulary more)
FIXED_OVERHEAD = 500 * 2**20


def weight_bytes(spec: str, choice: str, config: ModelConfig, device: str = "cpu") -> int:
    """Bytes the model's weights take once loaded: a GGUF's matrices as their blobs (weights: gguf), an MLX
    checkpoint's groups (weights: mlx), else every parameter in fp32."""
    from tfq.model.load import activations_of, weights_kind
    from tfq.plan.fields import KEPT_GGUF

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
