"""A decoder layer in one C++ call (kernels/layer.py) gives every stream the bits of the layer run op by op, and
the start-up guard refuses one that does not; so do a model's layers as one object (a dense model's, a mixture
of experts' in fp32 and in GGUF blocks, a row whose route is unsure included, and a Qwen3.5 hybrid's)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engines import alone, bits, run
from test_gguf_hybrid import converter  # noqa: F401 (a fixture)
from test_gguf_moe import converted  # noqa: F401 (a fixture)
from test_hybrid import Oracle, hybrid, hybrid_dir  # noqa: F401 (fixtures)
from test_hybrid import requests as hybrid_requests
from test_moe import REAL_RATIOS, hybrid_moe_dir, moe_dir  # noqa: F401 (fixtures)
from test_quant import tiny_file  # noqa: F401 (a fixture)
from tfq.engine.core import EngineSettings
from tfq.engine.layer_guard import CHAIN, ONE_CALL, ONE_CALL_STORE, STACKED, STACKED_HEAD, STACKED_STORE, LayerProof
from tfq.engine.stream import Request
from tfq.kernels.contract import KEY_TILE
from tfq.model.load import load_model
from tiny import tiny_model_dir

SETTINGS = {
    "fp32, whole": EngineSettings(window=256, lanes=3, prefill_chunk=512),
    "bf16, paged, chunked": EngineSettings(window=256, lanes=3, prefill_chunk=13, kv_dtype="bf16",
                                           page_rows=KEY_TILE, paged_all=True, pool_pages=12),
    "fp8, partial": EngineSettings(window=512, lanes=3, prefill_chunk=128, kv_dtype="fp8", partial=True),
}


def replies(model, settings: EngineSettings) -> list[tuple[list[int], list[str]]]:
    g = torch.Generator().manual_seed(4)
    requests = [Request(tuple(torch.randint(3, 500, (n,), generator=g).tolist()), max_tokens=8) for n in (2, 40, 300)]
    return bits(run(model, requests, settings))


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_engine_runs_each_layer_in_one_call_with_the_bits_of_the_ops(tiny_models, family, name, monkeypatch):
    """qwen2 (q/k/v bias) and qwen3 (q/k norms), fp32, bf16 and fp8 caches (which saturate), both arithmetics:
    the ids and logits digests of every reply are the same with the layer in one call as op by op, and the one
    call really ran."""
    model = tiny_models[family].model
    assert model.runs_in_one_call(model.layers[0])
    calls = []
    one = model.backend.layer
    monkeypatch.setattr(model, "backend",
                        dataclasses.replace(model.backend, layer=lambda *a: calls.append(1) or one(*a)))
    fused = replies(model, SETTINGS[name])
    assert len(calls) > 0
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    assert replies(model, SETTINGS[name]) == fused


def with_stack_forward(model, monkeypatch, stack_forward) -> None:
    """The model's backend with another stack_forward, its one object kept (it runs only with its own backend)."""
    backend = dataclasses.replace(model.backend, stack_forward=stack_forward)
    monkeypatch.setattr(model, "backend", backend)
    monkeypatch.setattr(model, "stack", model.stack._replace(backend=backend))


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_dense_model_runs_its_layers_as_one_object_with_the_bits_of_each_layer(tiny_models, family, name,
                                                                                 monkeypatch):
    """A dense model's forward runs every layer, the final norm and the head in one call to its one object
    (kernels/cpu/layer.cpp): the ids and logits digests of every reply are those of the layers in one call each and
    the head op by op, and of the layers op by op."""
    model = tiny_models[family].model
    assert model.runs_as_stack() and model.stack.handle.head
    heads = []  # whether each call ran the head too (its logit rows given)
    one = model.backend.stack_forward
    with_stack_forward(model, monkeypatch, lambda *a: heads.append(a[5] is not None) or one(*a))
    stacked = replies(model, SETTINGS[name])
    assert heads and all(heads)
    monkeypatch.setattr(model, "stack", None)
    assert not model.runs_as_stack() and replies(model, SETTINGS[name]) == stacked
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    assert replies(model, SETTINGS[name]) == stacked


def test_a_dense_model_on_8_bit_activations_takes_silu_times_up_from_its_gate_up_kernel(tiny_file,  # noqa: F811
                                                                                        monkeypatch):
    """A dense GGUF model with 8-bit activations (gguf-q8; the default model's types): its MLP's gate_up blob pairs
    whole panels, so the one object and each layer in one call take SiLU times up from the gate_up kernel
    (kernels/cpu/quant_q8.cpp: linear_glu); every reply's ids and logits digests are those of the layers op by op
    (gate_up, tfq's SiLU, torch's product), paged and chunked too."""
    model = load_model(str(tiny_file), progress=False, weights="gguf-q8").model
    gate_up = model.layers[0].fused.gate_up
    assert gate_up.panels.dtype == torch.uint8 and model.config.intermediate_size % 16 == 0  # the pairing holds
    assert model.runs_as_stack()
    for name in ("fp32, whole", "bf16, paged, chunked"):
        stacked = replies(model, SETTINGS[name])
        with monkeypatch.context() as m:
            m.setattr(model, "stack", None)
            assert replies(model, SETTINGS[name]) == stacked
            m.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
            assert replies(model, SETTINGS[name]) == stacked


def mixture_model(weights: str, moe_dir, request, family: str = "qwen3_moe"):  # noqa: F811 (the fixture's name)
    """The tiny Qwen3 MoE of the real ratios (tests/test_moe.py; or its Qwen3.5 MoE, a hybrid with a shared expert):
    its HF folder in fp32, or llama.cpp's Q8_0 conversion of it (tests/test_gguf_moe.py) kept in its blocks with fp32
    (gguf) or 8-bit (gguf-q8) activations."""
    if weights == "fp32":
        folder = moe_dir if family == "qwen3_moe" else request.getfixturevalue("hybrid_moe_dir")
        return load_model(str(folder), progress=False).model
    files = request.getfixturevalue("converted")(family)[1]
    return load_model(str(files["q8_0"]), progress=False, weights=weights).model


def counted_stack(model, monkeypatch) -> list[int]:
    """The model's one object counted: what each call gave (the start-up guard's one-layer object's too)."""
    stops, one = [], model.backend.stack_forward
    with_stack_forward(model, monkeypatch, lambda *a: stops.append(one(*a)) or stops[-1])
    return stops


@pytest.mark.parametrize("name", ["fp32, whole", "bf16, paged, chunked"])
@pytest.mark.parametrize("weights", ["fp32", "gguf", "gguf-q8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_a_mixture_runs_its_layers_as_one_object_with_the_bits_of_each_layer(moe_dir, request, weights,  # noqa: F811
                                                                             name, family, monkeypatch):
    """A Qwen3 MoE's forward runs every layer (attention half, router, routes, experts and combine, residual) in
    one call to its one object, in fp32 and on GGUF blocks; so does a Qwen3.5 MoE's (DeltaNet and gated attention
    layers, each mixture with its shared expert): the ids and logits digests of every reply are those of each layer
    in its calls (attention_layer, moe_route, moe_mixture; a DeltaNet layer with a mixture has no call of its own),
    and of the layers op by op with the mixture in Python (route, expert_outputs, combine, the shared expert)."""
    model = mixture_model(weights, moe_dir, request, family)
    assert model.runs_as_stack() and model.stack.handle is not None
    stops = counted_stack(model, monkeypatch)
    stacked = replies(model, SETTINGS[name])
    # the engine's forwards ran the whole object, not only the guard's one-layer ones (a forward with a row whose
    # route is unsure stops at its layer: the test below forces one)
    assert any(s.layer == len(model.layers) for s in stops)
    if model.config.moe.shared_intermediate:  # RED: the object built without its shared experts
        unshared = [dataclasses.replace(w, mixture=dataclasses.replace(w.mixture, shared=()))
                    for w in (layer.fused for layer in model.layers)]
        with monkeypatch.context() as m:
            m.setattr(model, "stack", model.stack._replace(handle=model.backend.stack(unshared, model.layer_sizes,
                                                                                        model.sizes)))
            assert model.runs_as_stack() and replies(model, SETTINGS[name]) != stacked
    monkeypatch.setattr(model, "stack", None)
    assert not model.runs_as_stack() and replies(model, SETTINGS[name]) == stacked
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, moe_route=None, moe_mixture=None))
    assert replies(model, SETTINGS[name]) == stacked


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_a_row_whose_route_is_unsure_gets_routes_answer_in_the_one_object(moe_dir, request, family,  # noqa: F811
                                                                          monkeypatch):
    """A router scaled up a thousand times puts most exps of a row below float32's normals, which the C++ route
    cannot round for sure (kernels/cpu/moe_parts.h: moe_route): the one object stops at that layer (a Qwen3.5 MoE's
    first, a DeltaNet layer with a shared expert), route (mpmath) answers those rows, and the object goes on from
    the next layer; every reply's bits are those of each layer in its calls and of the layers op by op. The control
    leaves the unsure rows with the C++ route's zeros, and the bits move."""
    from safetensors.torch import load_file

    from tfq.model import moe

    model = mixture_model("fp32", moe_dir, request, family)
    folder = moe_dir if family == "qwen3_moe" else request.getfixturevalue("hybrid_moe_dir")
    weight = load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.gate.weight"]
    first = model.layers[0]
    scaled = dataclasses.replace(first, moe=dataclasses.replace(first.moe, router=model.make_linear(1000 * weight)))
    monkeypatch.setattr(model, "layers", [scaled, *model.layers[1:]])
    monkeypatch.setattr(model, "stack", model.one_object())
    assert model.runs_as_stack()
    stops = counted_stack(model, monkeypatch)
    stacked = replies(model, SETTINGS["fp32, whole"])
    assert any(s.layer == 0 and s.h.numel() for s in stops)  # a forward stopped at layer 0, then ran the rest
    control = moe.filled_routes
    monkeypatch.setattr(moe, "filled_routes", lambda fast, logits, chosen, normalized: fast(logits, chosen,
                                                                                            normalized)[:2])
    assert replies(model, SETTINGS["fp32, whole"]) != stacked  # RED: the unsure rows need route's answer
    monkeypatch.setattr(moe, "filled_routes", control)
    monkeypatch.setattr(model, "stack", None)
    assert replies(model, SETTINGS["fp32, whole"]) == stacked
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, moe_route=None, moe_mixture=None))
    assert replies(model, SETTINGS["fp32, whole"]) == stacked


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_control_the_guard_refuses_layers_as_one_object_one_ulp_off(tiny_models, moe_dir, family,  # noqa: F811
                                                                    monkeypatch):
    """A one-object forward (a dense model's; a mixture of experts') whose outputs are one unit in the last place
    away from the ops' must be refused, named; the same object unharmed is proved (it ran in the proof); and a model
    whose layers were swapped after its object was built runs them, not the object."""
    model = tiny_models["qwen3"].model if family == "qwen3" else load_model(str(moe_dir), progress=False).model
    one = model.backend.stack_forward

    def nudged(*a):
        out = one(*a)
        return out._replace(x=torch.nextafter(out.x, torch.tensor(float("inf"))))

    with_stack_forward(model, monkeypatch, nudged)
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    assert failure is not None and failure.op == STACKED, failure
    monkeypatch.undo()
    calls = []
    with_stack_forward(model, monkeypatch, lambda *a: calls.append(1) or one(*a))
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None and calls
    monkeypatch.undo()
    monkeypatch.setattr(model, "layers", [dataclasses.replace(layer) for layer in model.layers])
    assert not model.runs_as_stack()


def test_control_the_guard_refuses_a_head_in_the_one_object_one_ulp_off(tiny_models, monkeypatch):
    """An object whose head takes its final norm one ulp off (its layers unharmed) is refused, named: the guard
    runs the head the object holds against the final norm and head op by op."""
    model = tiny_models["qwen3"].model
    build = model.stack_of

    def off(layers):
        with monkeypatch.context() as m:
            m.setattr(model, "norm", torch.nextafter(model.norm, torch.tensor(float("inf"))))
            return build(layers)

    monkeypatch.setattr(model, "stack_of", off)
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    assert failure is not None and failure.op == STACKED_HEAD, failure
    monkeypatch.setattr(model, "stack_of", build)
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_moe, a dense layer", "hybrid", "qwen3_5_moe"])
def test_control_the_guard_refuses_a_one_object_off_only_between_its_layers(tiny_models, moe_dir, hybrid,  # noqa: F811
                                                                           request, tmp_path_factory, family,
                                                                           monkeypatch):
    """The guard runs its layers in a row as one object too (a hybrid's attention, DeltaNet, attention): an object
    whose layers after the first take their input norm one ulp off (a fault of the pass between two layers: the
    residual with the next input norm; a one-layer object has none) is refused, named; unharmed, the object of
    several layers is built and proved. A mixture model's dense layer (mlp_only_layers) joins the row: an object off
    only in the pass out of its dense layer is refused too."""
    after_dense = family == "qwen3_moe, a dense layer"
    if after_dense:
        folder = tiny_model_dir(tmp_path_factory, "qwen3_moe", **dict(REAL_RATIOS, dense_layers=(1,)))
        model = load_model(str(folder), progress=False).model
    else:
        model = tiny_models["qwen3"].model if family == "qwen3" else hybrid.model if family == "hybrid" else \
            mixture_model("fp32", moe_dir, request, family)
    build, built = model.stack_of, []

    def off(layers):  # each layer after the first, or after a dense one, takes its input norm one ulp up
        up = torch.tensor(float("inf"))
        return build([layer if i == 0 or (after_dense and layers[i - 1].moe is not None) else
                      dataclasses.replace(layer, input_norm=torch.nextafter(layer.input_norm, up))
                      for i, layer in enumerate(layers)])

    monkeypatch.setattr(model, "stack_of", off)
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    assert failure is not None and failure.op == CHAIN, failure
    monkeypatch.setattr(model, "stack_of", lambda layers: built.append(len(layers)) or build(layers))
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None
    assert max(built) == (2 if family in ("qwen3", "qwen3_moe") else 3)  # a hybrid's three, or moe, dense, moe


def test_control_the_guard_refuses_a_one_call_layer_one_ulp_off(tiny_models, monkeypatch):
    """A one-call layer whose outputs are one unit in the last place away from the ops' must be refused, named."""
    model = tiny_models["qwen2"].model
    one = model.backend.layer
    nudged = lambda *a: torch.nextafter(one(*a), torch.tensor(float("inf")))  # noqa: E731
    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, layer=nudged))
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    assert failure is not None and failure.op == ONE_CALL, failure
    monkeypatch.undo()
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None


def test_a_hybrid_runs_both_kinds_of_layer_in_one_call_with_the_bits_of_the_ops(hybrid, monkeypatch):  # noqa: F811 (the fixture)
    """A Qwen3.5 hybrid's DeltaNet layers and gated attention layers in one call each (kernels/cpu/delta_layer.cpp,
    layer.cpp with its gate and partial rotary): streams together, chunked, drafted with rejected guesses (the
    verify's inputs kept from the one call, rolled back) give the ids and logits bits of the layers run op by op."""
    model = hybrid.model
    assert all(model.runs_in_one_call(layer) for layer in model.layers)
    calls = {"layer": 0, "delta_layer": 0}

    def counted(name):
        real = getattr(model.backend, name)
        return lambda *a: calls.__setitem__(name, calls[name] + 1) or real(*a)

    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, layer=counted("layer"),
                                                              delta_layer=counted("delta_layer")))
    alone_runs = alone(model, hybrid_requests())
    oracle = lambda: Oracle({r.prompt: a.ids for r, a in zip(hybrid_requests(), alone_runs)})  # noqa: E731
    arms = [dict(lanes=5, prefill_chunk=13), dict(lanes=5, drafter=oracle())]
    fused = [run(model, hybrid_requests(), **arm) for arm in arms]
    assert calls["layer"] > 0 and calls["delta_layer"] > 0
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    assert bits(run(model, hybrid_requests())) == bits(alone_runs)
    arms[1]["drafter"] = oracle()
    for arm, got in zip(arms, fused):
        assert bits(run(model, hybrid_requests(), **arm)) == bits(got)


@pytest.mark.parametrize("harm", ["output", "state"])
def test_control_the_guard_refuses_a_deltanet_layer_one_ulp_off(hybrid, monkeypatch, harm):  # noqa: F811 (the fixture)
    """A DeltaNet layer in one call whose output, or whose streams' states, are one ulp from the ops' is refused,
    named."""
    model = hybrid.model
    real = model.backend.delta_layer
    up = torch.tensor(float("inf"))

    def nudged(x, weights, sizes, delta, state, clock):
        out, proj = real(x, weights, sizes, delta, state, clock)
        if harm == "state":
            state.rec.copy_(torch.nextafter(state.rec, up))
            return out, proj
        return torch.nextafter(out, up), proj

    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, delta_layer=nudged))
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    want = "deltanet: " + (ONE_CALL if harm == "output" else ONE_CALL_STORE)
    assert failure is not None and failure.op == want, failure
    monkeypatch.undo()
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None


@pytest.mark.parametrize("name", ["fp32, whole", "bf16, paged, chunked"])
def test_a_hybrid_runs_its_layers_as_one_object_with_the_bits_of_each_layer(hybrid, name, monkeypatch):  # noqa: F811
    """A Qwen3.5 hybrid's forward runs its DeltaNet and gated attention layers in one call to its one object
    (kernels/cpu/layer.cpp with delta_part.h): the ids and logits digests of every reply are those of each layer in
    one call, and of the layers op by op. (A drafting engine runs each layer in one call, which keeps a verify's
    inputs: tests/test_hybrid.py's drafted streams part from their runs alone without that.)"""
    model = hybrid.model
    assert model.config.hybrid and model.runs_as_stack() and model.stack.handle is not None
    stops = counted_stack(model, monkeypatch)
    stacked = replies(model, SETTINGS[name])
    assert any(s.layer == len(model.layers) for s in stops)  # the engine's forwards, not only the guard's
    monkeypatch.setattr(model, "stack", None)
    assert not model.runs_as_stack() and replies(model, SETTINGS[name]) == stacked
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    assert replies(model, SETTINGS[name]) == stacked


@pytest.mark.parametrize("harm", ["output", "state"])
def test_control_the_guard_refuses_a_hybrids_one_object_one_ulp_off(hybrid, monkeypatch, harm):  # noqa: F811
    """A hybrid's one object whose outputs, or whose streams' DeltaNet states, are one ulp from the ops' is refused,
    named by the layer's kind; unharmed, it is proved."""
    model = hybrid.model
    one, up = model.backend.stack_forward, torch.tensor(float("inf"))

    def nudged(x, handle, inputs, *rest):
        out = one(x, handle, inputs, *rest)
        if harm == "output":
            return out._replace(x=torch.nextafter(out.x, up))
        for rec in inputs.caches.rec:
            rec.copy_(torch.nextafter(rec, up))
        return out

    with_stack_forward(model, monkeypatch, nudged)
    failure = LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64)
    want = "attention: " + STACKED if harm == "output" else "deltanet: " + STACKED_STORE
    assert failure is not None and failure.op == want, failure
    monkeypatch.undo()
    assert LayerProof(model, "fp32", False).holds(torch.get_num_threads(), 64, 64) is None
