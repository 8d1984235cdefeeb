"""The exactness rule on tiny random checkpoints: every stream's ids and logits bits equal its run alone,
whatever else shares its forwards, wherever its cache lives, however its prompt is chunked."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines import WINDOW, alone, alone_once, engine, run
from tfq.engine.core import Engine, EngineSettings
from tfq.engine.runner import paged_partial
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.kernels.contract import KEY_TILE

DTYPES = ["fp32", "bf16", "fp16", "fp8"]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request, tiny_models):
    return tiny_models[request.param].model


def requests_strategy(vocab: int):
    one = st.builds(
        lambda n, t, temp, seed, salt: Request(
            tuple(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(salt)).tolist()),
            max_tokens=t, temperature=temp, seed=seed),
        n=st.integers(1, 300), t=st.integers(1, 12), temp=st.sampled_from([0.0, 0.0, 0.8]),
        seed=st.integers(0, 3), salt=st.integers(0, 10_000))
    return st.lists(one, min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streams_equal_their_runs_alone(model, data):
    requests = data.draw(requests_strategy(model.config.vocab_size))
    dtype = data.draw(st.sampled_from(DTYPES))
    page_rows = data.draw(st.sampled_from([0, KEY_TILE, 2 * KEY_TILE]))
    lanes = data.draw(st.integers(1, 8))
    need = max(len(r.prompt) + r.max_tokens for r in requests)  # rows the longest stream takes
    pool = 0
    if page_rows:
        one_stream = -(-need // page_rows)
        pool = data.draw(st.integers(one_stream, one_stream * lanes + 1))  # small pools force preemption
    cfg = EngineSettings(window=WINDOW, lanes=lanes, prefill_chunk=data.draw(st.integers(1, 300)), kv_dtype=dtype,
                         page_rows=page_rows, paged_all=data.draw(st.booleans()), pool_pages=pool)
    results = run(model, requests, cfg, page_order_seed=data.draw(st.integers(0, 99)))
    for req, got in zip(requests, results):
        ref = alone_once(model, req, kv_dtype=dtype)
        assert got.error is None
        assert got.ids == ref.ids
        assert got.digests == ref.digests


def test_logits_bits_equal_with_kept_tensors(model):
    """The digests stand for bits: compare the kept logits tensors themselves once."""
    g = torch.Generator().manual_seed(7)
    reqs = [Request(tuple(torch.randint(0, 200, (n,), generator=g).tolist()), max_tokens=6) for n in (90, 3, 150)]
    alone_runs = alone(model, reqs, keep_logits=True)
    together = run(model, reqs, lanes=3, prefill_chunk=40, page_rows=KEY_TILE, pool_pages=9, keep_logits=True)
    for a, b in zip(alone_runs, together):
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)) and len(a.logits) == len(b.logits)


def long_requests(model, n=3):
    g = torch.Generator().manual_seed(11)
    return [Request(tuple(torch.randint(0, model.config.vocab_size, (300 + 40 * i,), generator=g).tolist()),
                    max_tokens=8) for i in range(n)]


def test_control_partial_differs_but_is_exact_on_its_own(model):
    reqs = long_requests(model)
    for r in reqs:  # RED: the partial arithmetic gives other bits than rows
        assert alone_once(model, r, partial=True).digests != alone_once(model, r).digests
    together = run(model, reqs, lanes=3, page_rows=KEY_TILE, pool_pages=30, partial=True)
    for r, got in zip(reqs, together):  # and partial obeys the rule against itself
        assert got.digests == alone_once(model, r, partial=True).digests


def test_control_paged_partial_changes_the_contiguous_stream(model):
    reqs = long_requests(model, 2)
    base = EngineSettings(window=WINDOW, lanes=2, page_rows=KEY_TILE, pool_pages=20)
    fine = run(model, reqs, base)
    faulty = run(model, reqs, base, arithmetic=paged_partial)
    first_alone = alone_once(model, reqs[0])
    assert fine[0].digests == first_alone.digests
    # the first stream sits on the contiguous lane, yet a paged neighbour switches its arithmetic: RED
    assert faulty[0].digests != first_alone.digests


def test_prompt_past_window_fails_alone_others_finish(model):
    reqs = long_requests(model, 2)
    too_long = Request(tuple([1] * (WINDOW + 5)), max_tokens=3, label="long")
    results = run(model, [reqs[0], too_long, reqs[1]], lanes=2, page_rows=KEY_TILE, pool_pages=20)
    assert results[1].finish == "error" and "window" in results[1].error
    for r, got in zip(reqs, (results[0], results[2])):
        assert got.error is None and got.digests == alone_once(model, r).digests


def test_pool_too_small_for_one_stream_fails_it_alone(model):
    small = Request(tuple(range(10)), max_tokens=4)
    big = Request(tuple(range(300)), max_tokens=4)
    results = run(model, [small, big], lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=3)
    assert results[0].error is None and results[0].ids == alone_once(model, small).ids
    assert results[1].finish == "error" and "kv.pool" in results[1].error


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0)])
def test_bad_settings_refused_before_start(model, bad):
    e = engine(model, lanes=2)
    with pytest.raises(TfqError):
        e.generate([Request((1, 2, 3), max_tokens=3), Request((1, 2), **{"max_tokens": 3, **bad})])
    assert e.forwards == 0


def test_stop_at_eos_and_window(model):
    ref = alone_once(model, Request((5, 6, 7), max_tokens=12))
    eos = ref.ids[4]
    got = run(model, [Request((5, 6, 7), max_tokens=12)], eos_ids=(eos,))[0]
    assert got.finish == "eos" and got.ids == ref.ids[:ref.ids.index(eos) + 1]
    short = run(model, [Request(tuple(range(60)), max_tokens=50)], window=KEY_TILE)[0]
    assert short.finish == "window" and len(short.ids) == KEY_TILE - 60


@pytest.mark.parametrize("sets", [
    [], ["kv.pages=64"], ["kv.pages=128", "kv.paged=all"], ["kv.pages=64", "kv.pool=9", "lanes=3"],
    ["kv.dtype=bf16", "kv.pages=64"], ["kv.dtype=fp8", "lanes=2"], ["kv.dtype=fp16", "kv.pages=64", "lanes=1"],
])
def test_plan_bytes_are_the_bytes_the_engine_allocates(tiny_dirs, tiny_models, sets):
    from tfq.plan import load_plan

    loaded = tiny_models["qwen2"]
    plan = load_plan(None, {}, ["window=512", "lanes=4", *sets]).replace(model=str(tiny_dirs["qwen2"]))
    layout = plan.layout(loaded.config)
    engine = Engine.from_plan(plan, layout, loaded)
    assert engine.cache.nbytes == layout.cache_bytes
    assert engine.cache.rows_total == layout.rows_total


def test_stop_string_ends_a_stream_and_trims_its_text(tiny_models):
    loaded = tiny_models["qwen2"]
    prompt = tuple(loaded.tokenizer.chat_ids([{"role": "user", "content": "def fibonacci(n):"}]))
    both = dict(lanes=2, tokenizer=loaded.tokenizer, eos_ids=(-1,))
    free = run(loaded.model, [Request(prompt, max_tokens=30)], **both)[0]
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip()
    other = Request(prompt, max_tokens=30, seed=1, temperature=0.7)
    got, beside = run(loaded.model, [Request(prompt, max_tokens=30, stop=(stop,)), other], **both)
    assert got.finish == "stop" and got.text == free.text[:free.text.index(stop)]
    assert got.ids == free.ids[:len(got.ids)] and len(got.ids) < len(free.ids)
    assert beside.digests == alone_once(loaded.model, other).digests


def test_preempted_stream_recomputes_its_cache_exactly(model):
    g = torch.Generator().manual_seed(3)
    reqs = [Request(tuple(torch.randint(0, 200, (100,), generator=g).tolist()), max_tokens=60) for _ in range(2)]
    # two pages each for the prompts, a third each past row 128: five pages cannot hold both
    cfg = EngineSettings(window=WINDOW, lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=5)
    results = run(model, reqs, cfg)
    assert results[1].recomputed >= 1  # the newer stream lost cached work and computed it again
    for r, got in zip(reqs, results):
        assert got.ids == alone_once(model, r).ids and got.digests == alone_once(model, r).digests
