"""Mixture-of-experts Qwen models (qwen3_moe, and qwen3_5_moe: the hybrid with a shared expert): the config as
transformers reads it, logits against transformers' own Qwen3MoeForCausalLM and Qwen3_5MoeForCausalLM, routing
and combine as functions of the row alone (and the control that combines in the batch's order of load, which is
not), the start-up guard over an MoE layer, and `tfq together` on models of the real ratios (128 experts, 8
chosen a row) at 2 and 3 threads (one count a family here; the note of the issue has both for both)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from cli import tfq
from engines import engine, run
from test_bench import TINY_PLAN
from test_forward import hf_model
from test_hybrid import shipped_hybrid_suite
from tfq.engine.core import EngineSettings
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.model import moe
from tfq.model.config import ModelConfig
from tfq.model.moe import Routes, combine, combine_by_load, filled_routes, route
from tiny import tiny_model_dir

# the real models' ratios (Qwen3-30B-A3B: 128 experts, 8 chosen, normalized), small sizes
REAL_RATIOS = dict(tie=True, seed=6, layers=4, hidden=128, heads=4, kv_heads=1, head_dim=64, intermediate=256,
                   experts=(128, 8, 32), branch_scale=0.3)
# Qwen3.5's: three DeltaNet layers to one attention layer, a shared expert beside the 128
HYBRID_RATIOS = dict(REAL_RATIOS, seed=4, intermediate=128, linear_heads=(2, 6), linear_dims=(32, 32))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "qwen3_moe", **REAL_RATIOS)


@pytest.fixture(scope="module")
def hybrid_moe_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "qwen3_5_moe", **HYBRID_RATIOS)


def test_the_config_reads_the_mixture_as_transformers_builds_it(moe_dir):
    config = ModelConfig.from_folder(moe_dir)
    m = config.moe
    assert (m.experts, m.chosen, m.intermediate, m.normalized) == (128, 8, 32, True)
    assert config.moe_layers == [0, 1, 2, 3]
    assert config.param_count() == sum(p.numel() for p in hf_model(moe_dir).parameters())
    h = config.hidden_size
    assert config.param_count() - config.active_param_count() == 4 * (128 - 8) * 3 * h * 32
    raw = json.loads((moe_dir / "config.json").read_text())
    sparse = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert sparse.moe_layers == [3]  # layer 1 dense by name, 0 and 2 by the step
    with pytest.raises(TfqError, match="num_experts_per_tok \\(0\\) must be between 1 and num_experts"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 0})


def test_the_hybrid_mixture_has_a_shared_expert_in_every_layer(hybrid_moe_dir):
    config = ModelConfig.from_folder(hybrid_moe_dir)
    m = config.moe
    assert config.family == "qwen3_5_moe" and config.hybrid and config.deltanet_layers == [0, 1, 2]
    assert (m.experts, m.chosen, m.normalized, m.shared_intermediate) == (128, 8, True, 128)
    assert config.moe_layers == [0, 1, 2, 3]
    assert config.param_count() == sum(p.numel() for p in hf_model(hybrid_moe_dir).parameters())
    # an image-and-text config: the text model inside, the vision tower skipped
    raw = json.loads((hybrid_moe_dir / "config.json").read_text())
    outer = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": raw,
                                   "vision_config": {"depth": 2}})
    assert outer.moe == m and outer.skipped == "the vision tower (2 blocks)"


@pytest.mark.parametrize("family, normalized", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_5_moe", True)])
def test_logits_match_transformers(tmp_path_factory, family, normalized):
    """Qwen3: a dense layer among the mixtures (mlp_only_layers); Qwen3.5: DeltaNet layers and the shared expert;
    a paged and chunked run, 32 greedy tokens."""
    sizes = dict(dense_layers=(1,), normalized=normalized) if family == "qwen3_moe" else dict(intermediate=96)
    folder = tiny_model_dir(tmp_path_factory, family, seed=3, layers=4, experts=(16, 4, 64), **sizes)
    from tfq.model.load import load_model

    loaded = load_model(str(folder), progress=False)
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(0, loaded.config.vocab_size, (150,), generator=g).tolist())
    settings = EngineSettings(window=512, lanes=2, prefill_chunk=50, page_rows=64, paged_all=True, pool_pages=8)
    got = run(loaded.model, [Request(prompt, max_tokens=32)], settings, keep_logits=True)[0]
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([prompt + tuple(got.ids[:-1])])).logits[0, len(prompt) - 1:]
    ours = torch.stack(got.logits)
    assert ours.shape == ref.shape == (32, loaded.config.vocab_size)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert got.ids == ref.argmax(-1).tolist()


def test_routing_is_transformers_routing_one_row_at_a_time():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 128, generator=g)
    routes = route(logits, 8, True)
    # transformers' router on the same logits (its weight the identity)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8, hidden_size=128,
                                               norm_topk_prob=True))
    with torch.no_grad():
        router.weight.copy_(torch.eye(128))
        _, weights, ids = router(logits)
    assert np.array_equal(routes.experts, ids.numpy())
    assert torch.allclose(routes.weights, weights, rtol=1e-6, atol=0)
    for i in range(64):  # a row's route is its own: the same bits alone
        alone = route(logits[i:i + 1], 8, True)
        assert np.array_equal(alone.experts[0], routes.experts[i]) and torch.equal(alone.weights[0], routes.weights[i])
    # ties go to the lower expert id: equal logits, and a tie across the cut
    tied = torch.zeros(2, 16)
    tied[1, [3, 9, 12]] = 1.0
    assert route(tied, 4, False).experts.tolist() == [[0, 1, 2, 3], [3, 9, 12, 0]]
    unnormalized = route(logits[:1], 8, False).weights
    assert float(unnormalized.sum()) < 1 and not torch.equal(unnormalized, routes.weights[:1])


def test_the_combine_is_the_rows_own_and_its_control_follows_the_batch():
    g = torch.Generator().manual_seed(1)
    rows, chosen, hidden = 48, 8, 64
    logits = torch.randn(rows, 32, generator=g)
    routes = route(logits, chosen, True)
    outputs = torch.randn(rows, chosen, hidden, generator=g)
    together = combine(outputs, routes.weights)
    parted = 0
    by_load = combine_by_load(outputs, routes.weights, routes)
    for i in range(rows):
        one = Routes(routes.experts[i:i + 1], routes.weights[i:i + 1])
        alone = combine(outputs[i:i + 1], one.weights)
        assert torch.equal(alone[0], together[i])
        # the control alone is the production arithmetic: what parts it in a batch is the batch
        assert torch.equal(combine_by_load(outputs[i:i + 1], one.weights, one)[0], alone[0])
        parted += not torch.equal(by_load[i], alone[0])
    assert parted > rows // 2  # RED: most rows' sums follow the batch's order of load


def _doubtful_exp() -> np.float32:
    """A float32 x < 0 whose exp lies so near a point halfway between two float32s that float64's value cannot
    round it for sure (tfq/nearest.py's test): the C++ route must hand such a row to mpmath."""
    from tfq.nearest import _doubtful

    xs = -np.random.default_rng(0).uniform(0, 8, 4_000_000).astype(np.float32)
    e = np.exp(xs.astype(np.float64))
    near = np.zeros(len(e), bool)
    near[_doubtful(e, np.empty(len(e), np.int64))] = True
    return xs[np.flatnonzero(near)[0]]


def test_the_routes_in_one_call_are_the_recipes_bits():
    """The C++ routes (kernels/cpu/moe.cpp) against route's numpy and mpmath: the same ids and weight bits, a
    row at a time and together; rows glibc cannot round for sure go to route. The control: softmax by torch, a
    recipe of its own, which the same comparison tells apart."""
    from tfq.kernels import cpu_build
    from tfq.kernels.moe import route_fixed

    if not cpu_build.load()[0]:
        pytest.skip("tfq's CPU kernels did not build here")
    g = torch.Generator().manual_seed(5)
    logits = torch.cat([3 * torch.randn(200, 128, generator=g), torch.randn(50, 128, generator=g).round(),
                        torch.zeros(2, 128)])  # rounded logits tie often; a row of zeros ties everywhere
    for normalized in (True, False):
        ids, weights, unsure = route_fixed(logits, 8, normalized)
        ref = route(logits, 8, normalized)
        assert len(unsure) == 0 and np.array_equal(ids.numpy(), ref.experts) and torch.equal(weights, ref.weights)
        for i in (0, 7, 251):
            one = route_fixed(logits[i:i + 1], 8, normalized)
            assert torch.equal(one[0][0], ids[i]) and torch.equal(one[1][0], weights[i])
    # RED: torch's softmax (its own exp and sum) moves some weights' bits
    probs = torch.softmax(logits, dim=1)
    assert not torch.equal(torch.gather(probs, 1, ids), route(logits, 8, False).weights)
    # rows glibc's exp cannot decide: an exp below float32's normals, and one at a float32 midpoint's edge
    x = _doubtful_exp()
    rows = torch.tensor([[0.0, -200.0, 1.0, -1.0], [0.0, float(x), -1.0, -2.0], [0.5, 0.25, -1.0, 2.0]])
    assert route_fixed(rows, 2, True)[2].tolist() == [0, 1]
    assert len(route_fixed(rows[:, [0, 2, 3]], 2, True)[2]) == 0  # the same rows without them
    ids, weights = filled_routes(route_fixed, rows, 2, True)  # what the engine runs: route fills those rows
    ref = route(rows, 2, True)
    assert np.array_equal(ids.numpy(), ref.experts) and torch.equal(weights, ref.weights)


def test_the_mixture_in_one_call_is_the_loops_bits(moe_dir):
    """The backend's one-call experts and combine (kernels/cpu/moe.cpp: moe_mixture) against expert_outputs
    and combine in Python, together and a row alone; the control hands the call each expert's neighbour."""
    from tfq.model.load import load_model
    from tfq.model.moe import expert_outputs

    model = load_model(str(moe_dir), progress=False).model
    if model.backend.moe_mixture is None:
        pytest.skip("tfq's CPU kernels did not build here")
    assert all(model.runs_in_one_call(layer) for layer in model.layers)  # the attention half in one call
    mix, inter = model.layers[0].moe, model.config.moe.intermediate
    h = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    routes = route(mix.router(h), mix.chosen, mix.normalized)
    ids = torch.from_numpy(routes.experts)
    loop = combine(expert_outputs(mix, h, routes, model.act), routes.weights)
    fixed = model.backend.moe_mixture(h, ids, routes.weights, mix.bank, inter)
    assert torch.equal(fixed, loop)
    for i in (0, 13):
        alone = model.backend.moe_mixture(h[i:i + 1], ids[i:i + 1], routes.weights[i:i + 1], mix.bank, inter)
        assert torch.equal(alone[0], loop[i])
    shifted = dataclasses.replace(mix, experts=mix.experts[1:] + mix.experts[:1]).bank
    assert not torch.equal(model.backend.moe_mixture(h, ids, routes.weights, shifted, inter), loop)  # RED


@pytest.mark.parametrize("activations", ["fp32", "q8"])
@pytest.mark.parametrize("inter, down", [(256, "Q6_K"), (384, "Q8_0")])
def test_the_mixture_on_kept_blocks_is_the_loops_bits(activations, inter, down):
    """Experts kept in GGUF blocks (gate and up Q4_K, down Q6_K or Q8_0), with fp32 activations (`weights: gguf`)
    or 8-bit ones (`gguf-q8`): the one-call mixture runs all their products in one parallel region (quant.cpp's and
    quant_q8.cpp's linear_many; a gate_up's panels in runs of 16, the last one shorter at 384 outputs); against
    each expert's layers called one by one in Python, at 1 to 100 rows (100: more than the buffers the call keeps
    between calls hold) and at one again after it; the control hands the call each expert's neighbour."""
    from test_quant import random_blocks
    from tfq.kernels import cpu_build
    from tfq.kernels.moe import mixture_fixed
    from tfq.kernels.quant import QuantLinear, from_blocks, join
    from tfq.kernels.rowwise import silu_fixed
    from tfq.model.moe import Expert, MoE, expert_outputs

    if not cpu_build.load()[0]:
        pytest.skip("tfq's CPU kernels did not build here")
    hidden, experts = 256, 8
    q = lambda kind, n, k, seed: from_blocks(kind, random_blocks(kind, n, k, seed), (n, k)).with_activations(  # noqa: E731
        activations)
    mix = MoE(None, [Expert(QuantLinear(join([q("Q4_K", inter, hidden, 3 * e), q("Q4_K", inter, hidden, 3 * e + 1)])),
                            QuantLinear(q(down, hidden, inter, 3 * e + 2))) for e in range(experts)], 3, True)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 3, 24, 100, 1):
        h = torch.randn(rows, hidden, generator=g)
        routes = route(torch.randn(rows, experts, generator=g), 3, True)
        loop = combine(expert_outputs(mix, h, routes, silu_fixed), routes.weights)
        ids = torch.from_numpy(routes.experts)
        assert torch.equal(mixture_fixed(h, ids, routes.weights, mix.bank, inter), loop)
    # one row naming an expert twice (the op takes any ids; the router never repeats one): each pair its own row
    twice = Routes(np.array([[2, 2, 5]]), torch.tensor([[0.5, 0.3, 0.2]]))
    loop_twice = combine(expert_outputs(mix, h[:1], twice, silu_fixed), twice.weights)
    assert torch.equal(mixture_fixed(h[:1], torch.from_numpy(twice.experts), twice.weights, mix.bank, inter),
                       loop_twice)
    shifted = dataclasses.replace(mix, experts=mix.experts[1:] + mix.experts[:1]).bank
    assert not torch.equal(mixture_fixed(h, ids, routes.weights, shifted, inter), loop)  # RED


def test_the_guard_refuses_a_combine_that_follows_the_batch(moe_dir, monkeypatch):
    from tfq.model.load import load_model

    loaded = load_model(str(moe_dir), progress=False)

    def flawed(outputs, weights):  # other bits whenever another row shares the forward
        total = combine(outputs, weights)
        return total * (1 + 2 ** -8) if outputs.shape[0] > 1 else total

    monkeypatch.setattr(moe, "combine", flawed)
    with pytest.raises(TfqError) as e:
        engine(loaded.model, window=256, lanes=4, prefill_chunk=64)
    assert "combine" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()  # the control's control: the same guard passes the plain combine (on a fresh model: the
    fresh = load_model(str(moe_dir), progress=False).model  # first keeps what its guard found)
    engine(fresh, window=256, lanes=4, prefill_chunk=64)
    # what the engine runs, the C++ experts and combine (kernels/cpu/moe.cpp), flawed the same way: the guard
    # finds the layer in one call apart from the ops
    model = load_model(str(moe_dir), progress=False).model
    if model.backend.moe_mixture is not None:
        op = model.backend.moe_mixture
        model.backend = dataclasses.replace(model.backend, moe_mixture=lambda h, *a: op(h, *a) * (
            1 + 2 ** -8 if h.shape[0] > 1 else 1))
        with pytest.raises(TfqError, match="layer in one call"):
            engine(model, window=256, lanes=4, prefill_chunk=64)


def test_tensor_parallelism_refuses_a_mixture_in_one_line(moe_dir):
    from tfq.model.load import load_model

    with pytest.raises(TfqError, match="tp: 2 does not split a mixture of experts yet.*use tp: 1"):
        load_model(str(moe_dir), progress=False, tp=2)


def test_the_plan_says_what_a_step_reads_of_the_experts(moe_dir, monkeypatch, capsys):
    code, out, err = tfq(["plan", "--model", str(moe_dir), "--set", "lanes=4", "--json"], monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(out)
    experts = report["model"]["experts"]
    config = ModelConfig.from_folder(moe_dir)
    h, i = config.hidden_size, 32
    assert experts["read_at_1_lane"]["parameters"] == config.active_param_count()  # tied: no lookup to leave out
    distinct = 128 * (1 - (1 - 8 / 128) ** 4)
    assert experts["read_at_lanes"]["experts_a_layer"] == round(distinct, 1)
    assert experts["read_at_lanes"]["parameters"] == round(config.param_count() - (128 - distinct) * 3 * h * i * 4)
    assert any(line.startswith("experts: 128 in each of 4 layers, 8 chosen a row") for line in report["lines"])


def test_bench_clocks_the_experts_apart_and_counts_the_experts_a_step_reads(moe_dir, tmp_path, monkeypatch, capsys):
    from tfq.bench import weights_read_bytes
    from tfq.model.load import load_model

    path = tmp_path / "bench.json"
    code, out, err = tfq(["bench", "--model", str(moe_dir), "--plan", str(TINY_PLAN), "--prompt-tokens", "12",
                          "--tokens", "4", "--repeats", "1", "--threads", "1", "--lanes", "1,4", "--peer", "none",
                          "--arms", "whole", "--json", str(path)], monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(path.read_text())
    for row in report["rows"]:
        b = row["breakdown_ms"]
        assert b["experts_ms"] > 0 and b["linear_ms"] > 0
        assert b["linear_ms"] + b["attention_ms"] + b["experts_ms"] + b["rest_ms"] == pytest.approx(b["step_ms"],
                                                                                                     abs=0.05)
    assert "experts" in " ".join(out.split())
    # the bytes: all experts in fp32 less those a step does not read, fewer at one lane than at four
    config, model = ModelConfig.from_folder(moe_dir), load_model(str(moe_dir), progress=False).model
    one, four = (weights_read_bytes(config, model, lanes) for lanes in (1, 4))
    assert one == 4 * config.active_param_count() and one < four < 4 * config.param_count()
    assert weights_read_bytes(config, None, 4) == four  # from the config alone, the same count
    assert {r["lanes"]: r["bytes_per_step"] > w for r, w in zip(report["rows"], (one, four))} == {1: True, 4: True}


@pytest.mark.parametrize("family, threads", [("qwen3_moe", 2), ("qwen3_5_moe", 3)])
def test_together_on_a_mixture_every_arm(moe_dir, hybrid_moe_dir, tmp_path, monkeypatch, capsys, family, threads):
    folder = moe_dir if family == "qwen3_moe" else hybrid_moe_dir
    summary = tmp_path / "summary.json"
    code, out, err = tfq(["together", "--model", str(folder), "--suite", str(shipped_hybrid_suite()), "--tokens",
                          "32", "--threads", str(threads), "--evidence", str(tmp_path / "ev"), "--json", str(summary)],
                         monkeypatch, capsys)
    assert code == 0, out + err
    arms = {a["arm"]: a for a in json.loads(summary.read_text())["arms"]}
    controls = {"partial", "paged-partial", "experts-by-load"}
    exact = {"whole", "paged-alone", "paged", "paged-all", "chunked", "preempted", "drafted", "drafted-model", "prefix"}
    if family == "qwen3_moe":  # the prefix cache's control: attention's arithmetic under it
        controls |= {"prefix-partial"}
    else:  # a hybrid's: its states kept one row late, and the chunked DeltaNet prefill
        controls |= {"prefix-offset", "deltanet-chunks"}
    assert set(arms) == exact | controls
    assert arms["experts-by-load"]["equal_logits"] < arms["experts-by-load"]["chats"]
    for name, arm in arms.items():
        assert arm["verdict"] == ("RED" if name in controls else "EXACT"), (name, arm["note"])
