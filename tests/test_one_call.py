"""A decoder layer in one C++ call (kernels/layer.py) gives every stream the bits of the layer run op by op, and
the start-up guard refuses one that does not."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tfq.engine import Engine, EngineSettings
from tfq.kernels.contract import KEY_TILE
from tfq.proofs.startup import ONE_CALL, LayerProof
from tfq.stream import Request

SETTINGS = {
    "fp32, whole": EngineSettings(window=256, lanes=3, prefill_chunk=512),
    "bf16, paged, chunked": EngineSettings(window=256, lanes=3, prefill_chunk=13, kv_dtype="bf16",
                                           page_rows=KEY_TILE, paged_all=True, pool_pages=12),
    "fp8, partial": EngineSettings(window=512, lanes=3, prefill_chunk=128, kv_dtype="fp8", partial=True),
}


def replies(model, settings: EngineSettings) -> list[tuple[list[int], list[str]]]:
    g = torch.Generator().manual_seed(4)
    requests = [Request(tuple(torch.randint(3, 500, (n,), generator=g).tolist()), max_tokens=8) for n in (2, 40, 300)]
    return [(r.ids, r.digests) for r in Engine(model, settings, eos_ids=()).generate(requests)]


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
    monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, layer=lambda *a: calls.append(1) or one(*a)))
    fused = replies(model, SETTINGS[name])
    assert len(calls) > 0
    monkeypatch.setattr(type(model), "runs_in_one_call", lambda self, layer: False)
    assert replies(model, SETTINGS[name]) == fused


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
