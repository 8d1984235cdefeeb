"""A mixture of experts in two calls to tfq's C++ kernels (kernels/cpu/moe.cpp): the routes, then the experts
with the combine. The arithmetic is tfq/model/moe.py's (route, expert_outputs, combine), which the start-up guard
compares with these calls row by row on the running build.

It exists for speed alone: at one lane a decode step spent about a third of a millisecond a layer in Python
(numpy's routing, the gather of each expert's rows, the combine's small ops) between the experts' kernels.
"""
from __future__ import annotations

import torch

from . import cpu_build


def route_fixed(logits: torch.Tensor, chosen: int,
                normalized: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids int64 [rows, chosen], weights float32 [rows, chosen], unsure) from the router's logits: `unsure` the
    rows (int64, most often none) where some exp lies too near a float32 midpoint for glibc's float64 value to
    decide it; their ids and weights are zeros, for the caller's route to fill."""
    return cpu_build.op("moe_route")(logits.float().contiguous(), chosen, normalized)


def expert_bank(gate_ups: list[torch.Tensor], downs: list[torch.Tensor]):
    """A mixture's experts (each one's gate_up and down panels, by id) held once in C++ for mixture_fixed."""
    cpu_build.ops()
    return torch.classes.tfq_cpu.ExpertBank(gate_ups, downs)


def mixture_fixed(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank, intermediate: int,
                  clock: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each row's ranks, in rank order, of weight * expert(h): each expert of `bank` (expert_bank) run
    once on the rows that chose it. `clock` (float64 [3]) gains the experts' seconds in [2]."""
    return cpu_build.op("moe_mixture")(h, ids, weights, bank, intermediate, clock)
