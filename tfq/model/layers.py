"""A decoder layer's weights as the forward takes them: an attention layer (a hybrid's gated one too), a hybrid's
Gated DeltaNet layer, each with its MLP (dense, or a mixture of experts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tfq.kernels.backend import LinearFn
from tfq.kernels.delta import DeltaWeights
from tfq.kernels.layer import AttentionWeights, DeltaLayerWeights
from tfq.model.moe import MoE


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    qkv: LinearFn
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn | None  # None where the MLP is a mixture of experts
    down: LinearFn | None
    gated: bool = False  # a hybrid's attention: qkv's last rows are a gate; the output is times sigmoid(gate)
    moe: MoE | None = None
    fused: AttentionWeights = field(init=False, repr=False)  # its weights as the one-call layer takes them

    def __post_init__(self):  # once, from fields that never change (dataclasses.replace builds a new layer)
        object.__setattr__(self, "fused", AttentionWeights(self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o,
                                                           self.post_norm, self.gate_up, self.down, self.gated,
                                                           self.moe.stacked if self.moe is not None else None))


@dataclass(frozen=True)
class DeltaLayer:
    """A hybrid's Gated DeltaNet layer: the projections in one linear layer (qkv | z | b | a), the recurrence's
    own tensors, the output projection, then the MLP as in every layer."""

    input_norm: torch.Tensor
    in_proj: LinearFn
    mixer: DeltaWeights
    out_proj: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn | None
    down: LinearFn | None
    moe: MoE | None = None
    fused: DeltaLayerWeights = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "fused", DeltaLayerWeights(self.input_norm, self.in_proj, self.mixer, self.out_proj,
                                                            self.post_norm, self.gate_up, self.down,
                                                            self.moe.stacked if self.moe is not None else None))


def linears(layer: Layer | DeltaLayer) -> dict[str, LinearFn]:
    """A layer's linear layers by field name (what tfq bench clocks and counts; a mixture's experts are not
    fields of the layer)."""
    names = ("qkv", "o") if isinstance(layer, Layer) else ("in_proj", "out_proj")
    return {name: getattr(layer, name) for name in names + ("gate_up", "down") if getattr(layer, name) is not None}
