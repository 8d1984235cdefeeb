"""Where a decode step's time goes: linear layers, attention, a mixture's experts (its router and each expert's
linear layers), and the rest (norms, rotary, activations, routing, the combine, the cache store, indexing, the
scheduler, sampling, Python). Where the layers run as the model's one object, the rest is split further: the part
inside the object's call (outside its kernels: norms, rotary, the cache store, the tensors each op makes) and the
part around it (the engine's Python: scheduling, the forward's rows and tables, the embedding, the draw).

A few decode steps run with a clock around every linear layer, every attention call and every expert of the
model (the clocks cost well under a microsecond each); the rest is the step's wall time less all three. Where a layer
runs as one C++ call (kernels/layer.py), the clock is inside it (`model.layer_clock`), around the same kernels. With
`top`, a second pass under the torch profiler names the ops that take the most time (the profiler adds its own
cost to every op, so its times only rank them; benchmarks/profile_step.py asks for it, `tfq bench` does not).
"""
from __future__ import annotations

import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tfq.model.layers import linears


class _Clock:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.seconds += time.perf_counter() - t0
            return out

        return timed


def _clocked(moe, clock: _Clock):
    """A mixture whose router and experts' linear layers run under `clock`."""
    def wrap(e):
        return e and dataclasses.replace(e, gate_up=clock.wrap(e.gate_up), down=clock.wrap(e.down))

    return dataclasses.replace(moe, router=clock.wrap(moe.router), experts=[wrap(e) for e in moe.experts],
                               shared=wrap(moe.shared),
                               shared_gate=moe.shared_gate and clock.wrap(moe.shared_gate))


def step_breakdown(engine, steps: int, top: int = 0) -> dict:
    """Split `steps` decode steps of a running engine (every stream past its prompt, enough tokens left to
    run 2 * steps + 1 more): {"step_ms", "linear_ms", "attention_ms", "experts_ms", "rest_ms", "top_ops"}, per
    step, and "rest_in_object_ms" (the part of the rest inside the one object's calls) where the layers run as one."""
    model = engine.runner.model
    engine.step()  # warm-up
    linear, attention, experts = _Clock(), _Clock(), _Clock()
    backend, layers, head = model.backend, model.layers, model.lm_head
    # the layers as one object (a Qwen3.5 MoE's DeltaNet layers have no call of their own; a drafting hybrid's
    # forwards leave the object), or each layer one C++ call: their own clock times the linear layers and attention
    # inside (a hybrid's DeltaNet recurrence counts as its attention there; op by op it counts in the rest)
    stacked = model.runs_as_stack(cache=engine.runner.cache)
    one_call = stacked or model.runs_in_one_call(layers[0])
    in_object = _Clock()  # the one object's calls, whole (a backend and its object replaced together, then put back)
    stack = model.stack
    if stacked:
        model.backend = dataclasses.replace(backend, stack_forward=in_object.wrap(backend.stack_forward))
        model.stack = stack._replace(backend=model.backend)
    if one_call:
        model.layer_clock = torch.zeros(3, dtype=torch.float64)  # linear layers, attention, experts
        if not model.runs_as_stack():  # the layers as one object clock their routers beside the experts themselves
            model.layers = [dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, router=experts.wrap(
                layer.moe.router))) if layer.moe else layer for layer in layers]  # the router beside its experts
    else:
        model.backend = dataclasses.replace(backend, attend=attention.wrap(backend.attend))
        model.layers = [dataclasses.replace(layer, **{name: linear.wrap(f) for name, f in linears(layer).items()},
                                            **({"moe": _clocked(layer.moe, experts)} if layer.moe else {}))
                        for layer in layers]  # a hybrid's DeltaNet recurrence counts in the rest
    model.lm_head = linear.wrap(head)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
        if one_call:
            linear.seconds += float(model.layer_clock[0])
            attention.seconds += float(model.layer_clock[1])
            experts.seconds += float(model.layer_clock[2])
        clocked_inside = float(model.layer_clock.sum()) if one_call else 0.0  # the kernels inside the calls
    finally:
        model.backend, model.layers, model.lm_head, model.layer_clock = backend, layers, head, None
        model.stack = stack
    ranked = []
    if top:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    per = 1e3 / steps

    def ms(seconds: float) -> float:  # to 0.1 us: a tiny model's attention is a few us a step
        return round(seconds * per, 4)

    rest = wall - linear.seconds - attention.seconds - experts.seconds
    inside = {"rest_in_object_ms": ms(in_object.seconds - clocked_inside)} if stacked else {}
    return {"step_ms": ms(wall), "linear_ms": ms(linear.seconds), "attention_ms": ms(attention.seconds),
            "experts_ms": ms(experts.seconds), "rest_ms": ms(rest), **inside,
            "top_ops": [{"op": e.key, "calls_per_step": e.count // steps,
                         "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3)} for e in ranked]}
