"""A mixture-of-experts MLP (Qwen3 MoE, Qwen3.5 MoE), one arithmetic per row whatever the batch.

A fused MoE kernel groups a batch's rows by expert, so a row's sums follow what else is in the batch. Here each
step of a row's computation depends on that row alone:

- routing: the router's logits row (a row-invariant linear layer), its softmax by the sampler's recipe (each
  exp(logit - max) rounded to the nearest float32, the sum one addition after another in float64, rounded
  once), the `chosen` largest probabilities with ties to the lower expert id, divided by their float32 sum in
  rank order when the config normalizes them;
- each expert runs on whichever rows chose it, through the row-invariant kernels: a row's output is the same
  bits whether one row chose that expert or a hundred;
- the combine adds a row's weighted expert outputs in the order of its own ranks (its largest weight first),
  one rounding a multiply and one an add; Qwen3.5's shared expert, gated by sigmoid, is added last.

A decode step reads each chosen expert once for all the rows that chose it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from tfq.kernels.backend import LinearFn
from tfq.kernels.delta import sigmoid_gate
from tfq.kernels.layer import MixtureWeights, fusable
from tfq.kernels.moe import expert_bank
from tfq.nearest import exp32

Tap = Callable[[str, torch.Tensor], torch.Tensor]  # (op name, its output) -> the output, unchanged


def untapped(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Expert:
    """One MLP: gate and up in one linear layer, then down."""

    gate_up: LinearFn
    down: LinearFn


@dataclass
class MoE:
    """A layer's router, its experts, and (Qwen3.5) the shared expert with its gate."""

    router: LinearFn
    experts: list[Expert]
    chosen: int
    normalized: bool
    shared: Expert | None = None
    shared_gate: LinearFn | None = None

    @cached_property
    def bank(self):
        """The experts as the backend's one-call mixture takes them (kernels/moe.py: expert_bank); None where some
        expert is not tfq's C++ linear layer (a clock's wrapper, a test's flawed kernel)."""
        if not fusable(*(f for e in self.experts for f in (e.gate_up, e.down))):
            return None
        return expert_bank([e.gate_up.panels for e in self.experts], [e.down.panels for e in self.experts])

    @cached_property
    def stacked(self) -> MixtureWeights | None:
        """The mixture as a model's one object runs it (kernels/layer.py: layer_stack), its shared expert too; None
        where the router, an expert or the shared one is not tfq's C++ linear layer, or the router or the shared
        expert has a bias."""
        shared = (self.shared.gate_up, self.shared.down, self.shared_gate) if self.shared is not None else ()
        fns = [self.router, *(f for e in self.experts for f in (e.gate_up, e.down)), *shared]
        if not fusable(*fns) or any(f.bias is not None for f in (self.router, *shared)):
            return None
        return MixtureWeights(self.router, [e.gate_up.panels for e in self.experts],
                              [e.down.panels for e in self.experts], self.chosen, self.normalized,
                              tuple(f.panels for f in shared))


@dataclass(frozen=True)
class Routes:
    """Each row's chosen experts, best first, and their weights: [rows, chosen]."""

    experts: np.ndarray  # int64
    weights: torch.Tensor  # float32


def route(logits: torch.Tensor, chosen: int, normalized: bool) -> Routes:
    """Routes from the router's logits [rows, experts] (float32, on the CPU): softmax, top-`chosen` (ties to the
    lower id), normalized or not; every step a function of the row alone, with one answer on every CPU."""
    x = logits.numpy()
    d = np.subtract(x, x.max(axis=1, keepdims=True), dtype=np.float64)  # exact: two float32s' difference
    e = exp32(d)
    total = np.cumsum(e, axis=1, dtype=np.float64)[:, -1:].astype(np.float32)  # in id order, rounded once
    p = e / total
    ids = np.argsort(-p, axis=1, kind="stable")[:, :chosen]  # a stable sort: the lower id first on a tie
    w = np.take_along_axis(p, ids, 1)
    if normalized:
        w = w / np.cumsum(w, axis=1, dtype=np.float32)[:, -1:]  # summed in rank order
    return Routes(ids, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))


def expert_outputs(moe: MoE, h: torch.Tensor, routes: Routes, act) -> torch.Tensor:
    """[rows, chosen, hidden]: each row's chosen experts' outputs in its rank order. Each expert the step's rows
    chose runs once, on the rows that chose it: the (row, rank) pairs are sorted by expert, their rows gathered
    once, and each expert runs on its slice of them."""
    rows, chosen = routes.experts.shape
    flat = routes.experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # pairs grouped by expert
    ends = [*(np.flatnonzero(np.diff(flat[order])) + 1).tolist(), len(flat)]
    index = torch.from_numpy(order).to(h.device)
    picked = h[index // chosen]  # each pair's row, grouped by expert
    grouped = torch.empty_like(picked)
    for start, end in zip([0, *ends[:-1]], ends):
        grouped[start:end] = mlp(moe.experts[int(flat[order[start]])], picked[start:end], act)
    out = torch.empty_like(grouped)
    out[index] = grouped  # back to (row, rank) order
    return out.view(rows, chosen, h.shape[1])


def combine(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ weight · output over a row's ranks, in rank order: [rows, hidden]."""
    w = weights.to(outputs.device)
    total = outputs[:, 0] * w[:, :1]
    for r in range(1, outputs.shape[1]):
        total = total + outputs[:, r] * w[:, r:r + 1]
    return total


def combine_by_load(outputs: torch.Tensor, weights: torch.Tensor, routes: Routes) -> torch.Tensor:
    """The control: as a fused kernel sums, expert by expert in the order of how many of the batch's rows chose
    them (the busiest first; then by the best rank any row gave them), each expert's weighted rows added into the
    total. Alone, a row's experts come in its rank order and the bits are `combine`'s; in a batch the order of
    addition follows the other rows, and so may the bits (must: a check that cannot see this is no check)."""
    ids = routes.experts
    w = weights.to(outputs.device)
    counts = np.bincount(ids.ravel())
    best = {int(e): int(np.nonzero(ids == e)[1].min()) for e in np.unique(ids)}
    total = torch.zeros(outputs.shape[0], outputs.shape[2], dtype=outputs.dtype, device=outputs.device)
    for e in sorted(best, key=lambda e: (-counts[e], best[e], e)):
        who, rank = (torch.from_numpy(a).to(outputs.device) for a in np.nonzero(ids == e))
        total.index_add_(0, who, outputs[who, rank] * w[who, rank][:, None])
    return total


def mlp(expert: Expert, h: torch.Tensor, act) -> torch.Tensor:
    """SiLU(gate) * up, then down: the dense MLP's arithmetic."""
    gate_up = expert.gate_up(h)
    half = gate_up.shape[1] // 2
    return expert.down(act(gate_up[:, :half]) * gate_up[:, half:])


@dataclass(frozen=True)
class Fused:
    """The backend's mixture in two C++ calls (kernels/moe.py: the routes, then the experts with the combine), the
    arithmetic of route, expert_outputs and combine; with the experts' size and the bench's clock."""

    route: Callable
    mixture: Callable
    intermediate: int
    clock: torch.Tensor | None = None

    def run(self, moe: MoE, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        ids, weights = filled_routes(self.route, logits, moe.chosen, moe.normalized)
        return self.mixture(h, ids, weights, moe.bank, self.intermediate, self.clock)


def filled_routes(fast: Callable, logits: torch.Tensor, chosen: int,
                  normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) by the backend's routes (kernels/moe.py: route_fixed), the rows it was unsure of by route."""
    ids, weights, unsure = fast(logits, chosen, normalized)
    if len(unsure):  # an exp glibc's float64 value could not round for sure: route asks mpmath
        exact = route(logits[unsure].float().cpu(), chosen, normalized)
        ids[unsure], weights[unsure] = torch.from_numpy(exact.experts), exact.weights
    return ids, weights


def moe_mlp(moe: MoE, h: torch.Tensor, act, tap: Tap, by_load: bool = False,
            fused: Fused | None = None) -> torch.Tensor:
    """The mixture's output for the post-norm rows h [rows, hidden] (before the residual); `fused`: the backend's
    two calls where every expert is tfq's C++ linear layer."""
    logits = tap("router", moe.router(h))
    if fused is not None and moe.bank is not None:
        total = fused.run(moe, h, logits)
    else:
        routes = route(logits.float().cpu(), moe.chosen, moe.normalized)
        tap("routing weights", routes.weights)
        outputs = tap("experts", expert_outputs(moe, h, routes, act))
        total = combine_by_load(outputs, routes.weights, routes) if by_load else combine(outputs, routes.weights)
        total = tap("combine", total)
    if moe.shared is not None:
        gate = moe.shared_gate(h).expand(-1, h.shape[1])
        total = tap("shared expert", total + sigmoid_gate(mlp(moe.shared, h, act), gate))
    return total
