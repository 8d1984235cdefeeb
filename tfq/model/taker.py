"""Named tensors out of a checkpoint's state dict, shape-checked, and cut to a tensor-parallel rank's share."""
from __future__ import annotations

import torch

from tfq.errors import TfqError
from tfq.kernels.quant import Quantized


class Taker:
    """Pulls named tensors out of a state dict, checking shapes, so a wrong checkpoint fails in one line."""

    def __init__(self, weights: dict[str, torch.Tensor], family: str, device: torch.device, offset: bool = False,
                 shard=None):
        self.source = weights  # a dict, or LazyTensors (each read when taken): only names are listed here
        self.names = {text_name(k): k for k in weights}
        self.replaced: dict[str, torch.Tensor] = {}
        self.family = family
        self.device = device
        self.offset = offset  # norms stored as weight - 1 (Qwen3.5)
        self.shard = shard  # tfq.parallel.shard.Shard: the rows and columns of each tensor this rank keeps

    def kept(self, name: str, t):
        """The rank's share of `t`, which the checkpoint names `name` (all of it without a shard): whole
        rows of a quantized matrix stay quantized; columns of one are cut from its fp32 values (the same)."""
        keep = self.shard.keep(name) if self.shard is not None else None
        if keep is None:
            return t
        rows, cols = keep
        if hasattr(t, "quantized"):  # a table left in its file's blocks (tfq.model.gguf_kept.BlockRows)
            t = t.quantized()
        if isinstance(t, Quantized):
            if cols is None:
                return t.select(torch.arange(t.shape[0])[rows])
            t = t.dequantized()
        t = t if rows is None else t[rows]
        return (t if cols is None else t[:, cols]).contiguous()

    def conv(self, name: str, channels: int, taps: int) -> torch.Tensor:
        """A depthwise convolution's weight [channels, 1, taps], from transformers' layout or MLX's [channels,
        taps, 1]."""
        w = self.get(name)
        if w is not None and tuple(w.shape) == (channels, taps, 1) and taps != 1:
            self.replaced[name] = w.transpose(1, 2)
        return self(name, (channels, 1, taps))

    def unstack_experts(self, m: str, experts: int) -> list[str]:
        """A mixture's experts stored stacked under `m` (experts.gate_up_proj [experts, 2 * inter, hidden] and
        experts.down_proj [experts, hidden, inter], as transformers holds them and Qwen3.5's published checkpoints
        store them) taken as one matrix an expert, under the names transformers writes them by; returns those
        names (to be let go once taken: they hold the stacked tensors)."""
        gate_up, down = self.get(m + "experts.gate_up_proj"), self.get(m + "experts.down_proj")
        if gate_up is None or down is None:
            return []
        half = gate_up.shape[1] // 2
        for e in range(min(experts, gate_up.shape[0])):
            self.replaced[f"{m}experts.{e}.gate_proj.weight"] = gate_up[e, :half]
            self.replaced[f"{m}experts.{e}.up_proj.weight"] = gate_up[e, half:]
            self.replaced[f"{m}experts.{e}.down_proj.weight"] = down[e]
        return [f"{m}experts.{e}.{w}_proj.weight" for e in range(min(experts, gate_up.shape[0]))
                for w in ("gate", "up", "down")]

    def norm(self, name: str, size: int) -> torch.Tensor:
        """An RMS norm's weight as it multiplies: Qwen3.5 multiplies by 1 + the stored weight (computed in fp32
        as transformers does, so the product's bits are the same)."""
        w = self(name, (size,))
        return 1.0 + w if self.offset else w

    def get(self, name: str):
        """The tensor the checkpoint names `name` (under tfq's names), or None."""
        if name in self.replaced:
            return self.replaced[name]
        return self.source[self.names[name]] if name in self.names else None

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise TfqError(f"checkpoint has no tensor {name}; its weights do not match its config.json "
                           f"(a {self.family} model): re-export or re-convert the checkpoint")
        if tuple(t.shape) != shape:
            raise TfqError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, config says {shape}")
        if not isinstance(t, torch.Tensor):  # Quantized, or a table in its file's blocks
            return self.kept(name, t)
        return self.kept(name, t.float()).contiguous().to(self.device)


def text_name(name: str) -> str:
    """A Qwen3.5 image-and-text checkpoint keeps the text model under model.language_model (transformers) or
    language_model.model and language_model.lm_head (MLX): the names tfq reads."""
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name
