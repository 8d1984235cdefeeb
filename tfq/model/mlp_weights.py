"""A layer's MLP out of a checkpoint's tensors: a dense one (gate and up in one linear layer, then down), or a
mixture of experts (the router, every expert, Qwen3.5's shared expert and its gate), and the joining of matrices
one under the other that both use."""
from __future__ import annotations

import torch

from tfq.kernels.quant import Quantized, Stacked, join, joinable
from tfq.model.config import ModelConfig
from tfq.model.moe import Expert, MoE


def stack(parts: list) -> torch.Tensor | Quantized | Stacked:
    """Matrices one under the other (q, k and v into one layer): quantized if all are, else fp32 (a quantized
    part dequantized: the same values)."""
    if joinable(parts):
        return join(parts)
    return torch.cat([p.dequantized() if isinstance(p, Quantized) else p for p in parts])


def take_mlp(take, m: str, intermediate: int, hidden: int, linear) -> Expert:
    """A dense MLP's gate and up (in one linear layer) and down, under the names prefixed `m`."""
    gate_up = stack([take(m + "gate_proj.weight", (intermediate, hidden)),
                     take(m + "up_proj.weight", (intermediate, hidden))])
    return Expert(linear(gate_up), linear(take(m + "down_proj.weight", (hidden, intermediate))))


def take_moe(take, m: str, c: ModelConfig, linear) -> MoE:
    """A mixture of experts under `m`: the router (transformers' `gate`), every expert (one tensor each, or stacked:
    tfq.model.taker.Taker.unstack_experts), and Qwen3.5's shared expert with its gate."""
    s, h = c.moe, c.hidden_size
    stacked = take.unstack_experts(m, s.experts)
    experts = [take_mlp(take, f"{m}experts.{e}.", s.intermediate, h, linear) for e in range(s.experts)]
    for name in stacked:  # they hold the stacked tensors
        del take.replaced[name]
    shared = gate = None
    if s.shared_intermediate:
        shared = take_mlp(take, m + "shared_expert.", s.shared_intermediate, h, linear)
        gate = linear(take(m + "shared_expert_gate.weight", (1, h)))
    return MoE(linear(take(m + "gate.weight", (s.experts, h))), experts, s.chosen, s.normalized, shared, gate)
