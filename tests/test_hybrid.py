"""Qwen3.5 hybrids (Gated DeltaNet + gated attention): transformers' numbers, and the exactness rule.

The reference is transformers' own `Qwen3_5ForCausalLM` on tiny random checkpoints written with its classes
(tests/tiny.py). tfq's DeltaNet arithmetic is the recurrence for every row, so a stream's bits are the same
alone or together, prefilled whole or in chunks of any size, drafted, preempted; the chunked algorithm (what
transformers prefills with) is the control, and must differ.
"""
from __future__ import annotations

import json

import pytest
import torch

import engines
from engines import WINDOW, one_forward, run
from tfq.engine.batch import Arithmetic, Feed, forward
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.core import Engine, EngineSettings
from tfq.engine.draft import ModelDrafter, NgramDrafter
from tfq.engine.runner import chunked_deltanet
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.kernels.contract import KEY_TILE
from tfq.model.config import ModelConfig
from tfq.model.load import load_model
from tiny import tiny_model_dir, write_tiny_checkpoint

KINDS = ("linear_attention", "linear_attention", "linear_attention", "full_attention",
         "linear_attention", "full_attention")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "qwen3_5", layers=len(KINDS), layer_types=KINDS)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_model(str(hybrid_dir), progress=False)


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()


def prompt(n: int, salt: int = 0, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1000 + n + salt)).tolist()


# ------------------------------------------------------------------------------------ against transformers

@pytest.mark.parametrize("n", [1, 63, 64, 65, 300])
def test_logits_match_transformers(hybrid, hf, n):
    ids = prompt(n)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = one_forward(hybrid, ids)
    scale = want.abs().max().item()
    # transformers' chunked algorithm rounds apart from the recurrence more with each 64-row chunk (at 300 rows a
    # one-ulp change of A moves the gap by 5%): the tolerance grows with the prompt past 150 rows
    tolerance = 2e-5 * scale * max(1.0, n / 150)
    assert (got - want).abs().max().item() <= tolerance, "logits beyond fp32 tolerance of transformers'"


def test_first_32_greedy_tokens_equal_transformers(hybrid, hf):
    ids = prompt(40, salt=3)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    got = run(hybrid.model, [Request(tuple(ids), max_tokens=32)])[0].ids
    assert got == want


def test_head_dims_off_the_vector_width_match_transformers_and_stay_exact(tmp_path_factory):
    """DeltaNet heads of 24 and 40 dims (not multiples of the kernels' 16 lanes) and a GQA ratio of 3."""
    from transformers import Qwen3_5ForCausalLM

    folder = tiny_model_dir(tmp_path_factory, "qwen3_5", seed=8, layers=4, linear_heads=(1, 3), linear_dims=(24, 40))
    loaded = load_model(str(folder), progress=False)
    hf = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(150, salt=8)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (one_forward(loaded, ids) - want).abs().max().item() <= 2e-5 * want.abs().max().item()
    reqs = requests(4)
    same(run(loaded.model, reqs, lanes=4, prefill_chunk=11), engines.alone(loaded.model, reqs))


def test_config_reads_layer_kinds_and_sizes(hybrid):
    c = hybrid.config
    assert c.kinds == KINDS and c.attention_layers == [3, 5] and c.deltanet_layers == [0, 1, 2, 4]
    assert c.rotary_dim == c.head_dim // 4
    n = c.deltanet
    assert (n.key_heads, n.value_heads, n.key_dim, n.value_dim, n.conv_kernel) == (2, 4, 32, 32, 4)
    state = n.value_heads * n.key_dim * n.value_dim + 3 * n.channels
    assert c.state_bytes == 4 * state * 4  # fp32, 4 DeltaNet layers


def test_param_count_is_the_checkpoint_s(hybrid_dir, hybrid):
    from tfq.model.weights import load_state_dict

    assert hybrid.config.param_count() == sum(t.numel() for t in load_state_dict(hybrid_dir).values())


# --------------------------------------------------------------------------------------------- exactness

def requests(n=5, tokens=24):
    lengths = (1, 7, 64, 65, 130, 300, 33)
    return [Request(tuple(prompt(lengths[i % len(lengths)], salt=i)), max_tokens=tokens,
                    temperature=0.0 if i % 2 == 0 else 0.9, seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def alone(hybrid):
    return engines.alone(hybrid.model, requests())


def same(results, reference):
    for got, want in zip(results, reference):
        assert got.ids == want.ids, "token ids differ from the stream's run alone"
        assert got.digests == want.digests, "logits bits differ from the stream's run alone"


@pytest.mark.parametrize("arm", [
    dict(lanes=5), dict(lanes=3), dict(lanes=5, prefill_chunk=7), dict(lanes=5, prefill_chunk=13),
    dict(lanes=5, prefill_chunk=1), dict(lanes=5, page_rows=KEY_TILE, pool_pages=40),
    dict(lanes=5, page_rows=KEY_TILE, pool_pages=40, paged_all=True),
])
def test_streams_equal_their_runs_alone(hybrid, alone, arm):
    same(run(hybrid.model, requests(), **arm), alone)


def test_preempted_streams_recompute_their_state_exactly(hybrid, alone):
    results, e = engines.run_on(hybrid.model, requests(), lanes=5, page_rows=KEY_TILE, pool_pages=8, paged_all=True,
                                prefill_chunk=29)
    assert e.scheduler.preemptions > 0, "nothing was preempted: the pool held every stream"
    same(results, alone)


class Oracle(NgramDrafter):
    """Guesses the reply the stream gives alone, with its last guess wrong: every verify accepts some rows and
    rejects one, so the state's roll-back runs on every verify, by construction."""

    def __init__(self, replies: dict[tuple, list[int]], k: int = 4):
        super().__init__(k)
        self.replies = replies

    def propose(self, streams, budgets):
        out = []
        for st, b in zip(streams, budgets):
            done = len(st.tokens) - len(st.request.prompt)
            guess = list(self.replies[st.request.prompt][done:done + b])
            if guess:
                guess[-1] = (guess[-1] + 1) % 512
            out.append(guess)
        return out


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "self"])
def test_drafted_streams_roll_their_state_back_exactly(hybrid, alone, drafter):
    d = {"ngram": lambda: NgramDrafter(4), "self": lambda: ModelDrafter(hybrid.model, 5, WINDOW),
         "oracle": lambda: Oracle({r.prompt: a.ids for r, a in zip(requests(), alone)})}[drafter]()
    results = run(hybrid.model, requests(), lanes=5, drafter=d)
    same(results, alone)
    proposed, accepted = sum(r.proposed for r in results), sum(r.accepted for r in results)
    if drafter == "oracle":
        assert 0 < accepted < proposed, "the oracle's guesses must be accepted in part and rejected in part"
    if drafter == "self":  # greedy streams draft their own tokens: accepted
        assert accepted > 0


def test_rejected_guesses_need_the_roll_back(hybrid, alone, monkeypatch):
    """Control: without the roll-back, a rejected guess's rows stay in the state, and the reply changes."""
    from tfq.model.qwen import Qwen

    monkeypatch.setattr(Qwen, "roll_back", lambda self, cache, slot, rows: None)
    results = run(hybrid.model, requests(), lanes=5,
                  drafter=Oracle({r.prompt: a.ids for r, a in zip(requests(), alone)}))
    assert any(g.digests != w.digests for g, w in zip(results, alone))


def test_control_chunked_prefill_then_recurrent_decode_differs(hybrid, alone):
    """transformers' way (prompt chunks by the chunked algorithm, decode rows by the recurrence) gives other
    bits: tfq never mixes the two."""
    results = run(hybrid.model, requests(), lanes=5, arithmetic=chunked_deltanet(False))
    long = [i for i, r in enumerate(requests()) if len(r.prompt) > 1]
    assert all(results[i].digests[0] != alone[i].digests[0] for i in long)
    # and the chunked arithmetic depends on the chunking, which is why it is not tfq's
    other = run(hybrid.model, requests(), lanes=5, arithmetic=chunked_deltanet(False), prefill_chunk=13)
    assert any(a.digests != b.digests for a, b in zip(results, other))


def test_chunked_control_is_within_tolerance_of_the_recurrence(hybrid):
    """The control computes the same function (it is the arithmetic that differs, not the model)."""
    ids = prompt(150, salt=9)
    cache = KVCache(hybrid.config, CacheSpec(lanes=1, window=WINDOW, slots=1))
    chunked = forward(hybrid.model, cache, [Feed(cache.pages.lane(0), 0, ids, len(ids))],
                      Arithmetic(chunked_deltanet=True))[0]
    rows = one_forward(hybrid, ids)
    assert not torch.equal(chunked, rows)
    assert (chunked - rows).abs().max().item() <= 1e-4 * rows.abs().max().item()


def test_threads_do_not_change_the_bits(hybrid, alone):
    before = torch.get_num_threads()
    try:
        for n in (1, 3, 8):
            torch.set_num_threads(n)
            same(run(hybrid.model, requests(), lanes=5, prefill_chunk=61), alone)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ checkpoints

def test_image_and_text_checkpoint_runs_its_text_model(tmp_path, hybrid):
    folder = write_tiny_checkpoint(tmp_path / "vl", "qwen3_5", layers=len(KINDS), layer_types=KINDS, vision=True)
    loaded = load_model(str(folder), progress=False)
    assert loaded.config.skipped == "the vision tower (2 blocks)"
    assert torch.equal(one_forward(loaded, prompt(70)), one_forward(hybrid, prompt(70)))


def write_config(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_unknown_layer_type_is_one_line(hybrid_dir, tmp_path):
    raw = json.loads((hybrid_dir / "config.json").read_text())
    raw["layer_types"][1] = "mamba"
    with pytest.raises(TfqError, match="layer type 'mamba' is not one tfq runs") as e:
        ModelConfig.from_folder(write_config(tmp_path, raw))
    assert "\n" not in str(e.value)


def test_vision_only_checkpoint_is_one_line(tmp_path):
    raw = {"model_type": "qwen3_5", "vision_config": {"depth": 27}}
    with pytest.raises(TfqError, match="vision-only checkpoint"):
        ModelConfig.from_folder(write_config(tmp_path, raw))


def test_bad_input_on_the_cli_exits_2_with_one_line(hybrid_dir, tmp_path, monkeypatch, capsys):
    from cli import tfq

    raw = json.loads((hybrid_dir / "config.json").read_text())
    raw["layer_types"][0] = "sparse_attention"
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hybrid_dir.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    write_config(bad, raw)
    code, out, err = tfq(["plan", "--model", str(bad)], monkeypatch, capsys)
    assert code == 2 and "layer type 'sparse_attention'" in err and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1


def drafter_guesses_after_a_rejection(model, restore: bool = True) -> tuple[tuple, tuple]:
    """(guesses and state of a hybrid drafter after the target kept only its first guess, the same of a fresh
    drafter over the same tokens)."""
    from tfq.engine.stream import Stream

    ids = prompt(90, salt=5)
    drafter = ModelDrafter(model, 1, WINDOW)
    st = Stream(0, Request(tuple(ids)), list(ids), lane=0)
    first = drafter.propose([st], [4])[0]
    wrong = (first[1] + 1) % 512
    st.tokens += [first[0], wrong]  # the target kept guess 0, drew another token than guess 1
    st.cached = len(ids) + 1
    if not restore:
        drafter.cache.state.copy = lambda source, target: None
    drafter.settle(st)
    after = drafter.propose([st], [4])[0]
    fresh_st = Stream(1, Request(tuple(st.tokens)), list(st.tokens), lane=0)
    fresh = ModelDrafter(model, 1, WINDOW)
    guesses = fresh.propose([fresh_st], [4])[0]
    return (after, drafter.cache.state.rec[0][0].clone()), (guesses, fresh.cache.state.rec[0][0].clone())


def test_hybrid_drafter_rolls_back_to_its_checkpoint(hybrid):
    (after, state), (fresh, fresh_state) = drafter_guesses_after_a_rejection(hybrid.model)
    assert after == fresh and torch.equal(state, fresh_state)


def test_hybrid_drafter_without_its_checkpoint_guesses_otherwise(hybrid):
    """Control: a drafter that keeps the rejected guesses' state has run rows the fresh one never saw."""
    (_, state), (_, fresh_state) = drafter_guesses_after_a_rejection(hybrid.model, restore=False)
    assert not torch.equal(state, fresh_state)


# ------------------------------------------------------------------------------------------ tfq together

def shipped_hybrid_suite():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "examples" / "tiny-hybrid.yaml"


@pytest.mark.slow
def test_together_on_a_hybrid_every_arm(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """`tfq together --model PATH` on a small random qwen3_5 model with the real models' ratios (three DeltaNet
    layers to one attention layer, value heads three times the key heads, head dim twice the DeltaNet's, GQA 6:1,
    tied embeddings as the small Qwen3.5 models have), the shipped tiny-hybrid suite: every arm EXACT, every
    control RED (the chunked DeltaNet one too). Its residual branches are scaled down so that it repeats itself
    enough for prompt lookup's guesses to be accepted (the drafted arm needs some)."""
    from cli import tfq

    folder = tiny_model_dir(tmp_path_factory, "qwen3_5", tie=True, seed=4, layers=8, hidden=192, heads=6,
                            kv_heads=1, head_dim=64, intermediate=640, linear_heads=(2, 6), linear_dims=(32, 32),
                            branch_scale=0.3)
    summary = tmp_path / "summary.json"
    code, out, err = tfq(["together", "--model", str(folder), "--suite", str(shipped_hybrid_suite()), "--tokens",
                          "32", "--evidence", str(tmp_path / "ev"), "--json", str(summary)], monkeypatch, capsys)
    assert code == 0, out + err
    assert "arms left out: prefix-partial" in err
    arms = {a["arm"]: a for a in json.loads(summary.read_text())["arms"]}
    controls = {"partial", "paged-partial", "deltanet-chunks", "prefix-offset"}
    assert set(arms) == {"whole", "paged-alone", "paged", "paged-all", "chunked", "preempted", "drafted",
                         "drafted-model", "prefix"} | controls
    for name, arm in arms.items():
        assert arm["verdict"] == ("RED" if name in controls else "EXACT"), (name, arm["note"])
    assert arms["preempted"]["preemptions"] > 0
    assert arms["prefix"]["reused_rows"] > 0 and arms["prefix-offset"]["reused_rows"] > 0


def test_hybrid_arms_refused_where_they_do_not_apply(tiny_dirs, hybrid_dir, tmp_path, monkeypatch, capsys):
    from cli import tfq

    for model, arm in ((tiny_dirs["qwen2"], "deltanet-chunks"), (tiny_dirs["qwen2"], "prefix-offset"),
                       (hybrid_dir, "prefix-partial")):
        code, out, err = tfq(["together", "--model", str(model), "--suite", str(shipped_hybrid_suite()), "--arms",
                              arm, "--evidence", str(tmp_path / arm)], monkeypatch, capsys)
        assert code == 2 and f"arm {arm} does not apply to this model" in err
        assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ the plan

@pytest.mark.parametrize("sets", [[], ["kv.pages=64", "kv.paged=all"], ["draft=ngram:3"], ["draft=self", "lanes=2"],
                                  ["kv.pages=64", "kv.paged=all", "kv.prefix_cache=on"]])
def test_plan_counts_the_state_the_engine_allocates(hybrid_dir, hybrid, sets):
    from tfq.plan import load_plan, plan_lines

    plan = load_plan(None, {}, ["window=512", "lanes=4", *sets]).replace(model=str(hybrid_dir))
    layout = plan.layout(hybrid.config)
    engine = Engine.from_plan(plan, layout, hybrid)
    assert engine.cache.nbytes == layout.cache_bytes
    assert layout.state_bytes == engine.cache.state.nbytes > 0
    lines = "\n".join(plan_lines(plan, hybrid.config, layout))
    assert "state: 4 DeltaNet layers x (recurrence 4 x 32 x 32 + convolution window 3 x 256) x 4 bytes" in lines
    assert ("drafting keeps a second copy, from before each verify" in lines) == any(
        s.startswith("draft") for s in sets)
    assert ("the prefix cache keeps 16 more states" in lines) == ("kv.prefix_cache=on" in sets)
    assert "4 DeltaNet + 2 gated attention" not in lines and "4 Gated DeltaNet + 2 gated attention" in lines


def test_a_hybrids_prefix_cache_is_refused_across_ranks(hybrid_dir, hybrid):
    from tfq.plan import load_plan

    plan = load_plan(None, {}, ["kv.pages=64", "kv.prefix_cache=on", "tp=2"]).replace(model=str(hybrid_dir))
    with pytest.raises(TfqError, match="keeps its DeltaNet states in one process so far; use tp: 1"):
        plan.layout(hybrid.config)


def test_a_warm_hybrid_starts_from_the_state_kept_at_its_last_page(hybrid_dir, hybrid):
    """The prefix cache on a hybrid: a prompt's chunks end at page boundaries, where its DeltaNet state is kept; a
    second stream with the same prompt maps the pages up to the last kept state, starts its recurrence from it,
    and draws what a cold run draws, logits bit for bit. With the states evicted (none kept), nothing is mapped."""
    from tfq.plan import load_plan

    plan = load_plan(None, {}, ["window=512", "lanes=2", "kv.pages=64", "kv.paged=all", "kv.prefix_cache=on",
                                "prefill_chunk=100"]).replace(model=str(hybrid_dir))
    engine = Engine.from_plan(plan, plan.layout(hybrid.config), hybrid)
    prompt = tuple(range(3, 3 + 200))
    cold = engine.generate([Request(prompt, max_tokens=6)])[0]
    assert len(engine.cache.state.kept) == 3  # rows 64, 128, 192: the chunks of 100 were cut at each page's end
    warm = engine.generate([Request(prompt, max_tokens=6)])[0]
    assert warm.reused == 192 and (warm.ids, warm.digests) == (cold.ids, cold.digests)
    engine.cache.state.kept.clear()
    engine.cache.state.spare = list(range(engine.cache.state.kept_rec[0].shape[0]))
    assert engine.generate([Request(prompt, max_tokens=6)])[0].reused == 0


def test_a_hybrid_of_deltanet_layers_only_is_proved_and_exact(tmp_path):
    """transformers' default layer types give a 2-layer qwen3_5 no attention layer at all: the guard proves the
    one kind it has, and streams together equal their runs alone."""
    folder = write_tiny_checkpoint(tmp_path / "deltanet-only", "qwen3_5", layers=2)
    loaded = load_model(str(folder), progress=False)
    assert loaded.config.attention_layers == []
    requests = [Request(prompt=tuple(range(3 + i, 40 + 9 * i)), max_tokens=6) for i in range(3)]
    settings = EngineSettings(window=256, lanes=3)
    for got, alone in zip(run(loaded.model, requests, settings), engines.alone(loaded.model, requests, settings)):
        assert got.ids == alone.ids and got.digests == alone.digests
