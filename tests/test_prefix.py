"""The prefix cache: a warm stream maps the full pages an earlier stream computed for the same tokens, and its
reply equals its cold run alone, ids and logits bits; reference counts return to zero and every page comes back.
The same on a hybrid (qwen3_5), whose warm streams also start their DeltaNet layers from the state kept at the last
page they map."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines import WINDOW, alone_once
from engines import engine as make_engine
from tfq.engine.core import Engine, EngineSettings
from tfq.engine.runner import ColdPartial
from tfq.engine.stream import Request
from tfq.kernels.contract import KEY_TILE


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen3_5"])
def model(request, tiny_models, tmp_path_factory):
    if request.param == "qwen3_5":
        from tfq.model.load import load_model
        from tiny import tiny_model_dir

        kinds = ("linear_attention", "full_attention", "linear_attention", "full_attention")
        folder = tiny_model_dir(tmp_path_factory, "qwen3_5", layers=4, layer_types=kinds, branch_scale=0.3)
        return load_model(str(folder), progress=False).model  # it repeats itself: drafted guesses are accepted
    return tiny_models[request.param].model


def cold(model, request: Request) -> tuple[list[int], list[str]]:
    """The request alone, on a whole plan without pages or a prefix cache."""
    r = alone_once(model, request)
    return r.ids, r.digests


def drive(engine: Engine, requests: list[Request], arrivals: list[int]):
    """Add request i at step arrivals[i], step until done; results in the requests' order."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids: dict[int, int] = {}
    step = 0
    while order or engine.has_work():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            ids[i] = engine.add(requests[i])
        if engine.has_work():
            engine.step()
        step += 1
    return [engine.result(ids[i]) for i in range(len(requests))]


def all_back(engine: Engine) -> bool:
    pages = engine.pages
    return sum(pages.refs) == 0 and pages.unheld == pages.pool_pages == len(pages.free) + len(pages.prefix.idle)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_warm_stream_maps_the_pages_and_equals_its_cold_run(model):
    vocab = model.config.vocab_size
    system = tokens(200, 1, vocab)
    first, second = (Request(tuple(system + tokens(30, s, vocab)), max_tokens=8) for s in (2, 3))
    engine = make_engine(model, lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=16, prefix_cache=True)
    a = engine.generate([first])[0]
    b = engine.generate([second])[0]
    assert a.reused == 0 and b.reused == 3 * KEY_TILE  # 200 shared tokens: three full 64-row pages
    assert (a.ids, a.digests) == cold(model, first) and (b.ids, b.digests) == cold(model, second)
    again = engine.generate([first])[0]  # 237 rows were cached: three full pages, all three found again
    assert again.reused == 3 * KEY_TILE
    assert (again.ids, again.digests) == cold(model, first)
    assert all_back(engine) and engine.pages.prefix.reused_rows == b.reused + again.reused


def prompt_tree(draw, vocab: int) -> list[Request]:
    """Requests whose prompts share prefixes: a root, a few branches off it, each request its own tail."""
    root = tokens(draw(st.integers(0, 260)), draw(st.integers(0, 999)), vocab)
    branches = [tokens(draw(st.integers(0, 90)), draw(st.integers(0, 999)), vocab) for _ in range(3)]
    out = []
    for _ in range(draw(st.integers(2, 7))):
        tail = tokens(draw(st.integers(1, 40)), draw(st.integers(0, 3)), vocab)  # seeds 0..3: some repeat
        out.append(Request(tuple(root + draw(st.sampled_from(branches)) + tail), max_tokens=draw(st.integers(1, 10)),
                           temperature=draw(st.sampled_from([0.0, 0.8])), seed=draw(st.integers(0, 2))))
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_prompt_trees_warm_equal_cold(model, data):
    """Random prompt trees, page sizes, pools small enough to evict and preempt, arrival orders, chunk sizes:
    every reply equals its cold run alone; at the end every reference is back to zero."""
    requests = prompt_tree(data.draw, model.config.vocab_size)
    page_rows = data.draw(st.sampled_from([KEY_TILE, 2 * KEY_TILE]))
    need = max(-(-(len(r.prompt) + r.max_tokens) // page_rows) for r in requests)
    lanes = data.draw(st.integers(2, 4))
    cfg = EngineSettings(window=WINDOW, lanes=lanes, prefill_chunk=data.draw(st.integers(8, 200)),
                         page_rows=page_rows, paged_all=data.draw(st.booleans()),
                         pool_pages=data.draw(st.one_of(st.integers(need, need + 1),  # tight: evict, preempt
                                                        st.integers(need, need * lanes + 2))), prefix_cache=True)
    engine = make_engine(model, cfg, page_order_seed=data.draw(st.integers(0, 9)))
    arrivals = [data.draw(st.integers(0, 30)) for _ in requests]
    for request, got in zip(requests, drive(engine, requests, arrivals)):
        assert got.error is None
        assert (got.ids, got.digests) == cold(model, request)
    assert all_back(engine)


def test_a_preempted_stream_finds_its_own_pages(model):
    """Preempted for lack of pages, a stream readmitted maps the full pages it computed while they are still
    cached: its pages go idle last-first, so its prefix is the last to be evicted."""
    vocab = model.config.vocab_size
    older = Request(tuple(tokens(100, 41, vocab)), max_tokens=100)  # grows to 4 pages of 64 rows
    newer = Request(tuple(tokens(200, 42, vocab)), max_tokens=100)  # 5 pages: 9 > the pool's 7
    engine = make_engine(model, lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=7, prefix_cache=True)
    a, b = engine.generate([older, newer])
    assert b.preempted > 0 and b.reused >= 3 * KEY_TILE  # at least its first three pages came back
    for request, got in ((older, a), (newer, b)):
        assert (got.ids, got.digests) == cold(model, request)
    assert all_back(engine)


def test_drafted_streams_share_only_verified_rows(model):
    from tfq.engine.draft import NgramDrafter

    if model.config.hybrid:
        pytest.skip("the tiny hybrid does not follow a repeated prompt, so no drafted guess is ever accepted")
    vocab = model.config.vocab_size
    loop = tokens(40, 5, vocab) * 4  # repeats: the n-gram drafter guesses, some guesses are rejected
    requests = [Request(tuple(loop + tokens(5, s, vocab)), max_tokens=30) for s in range(3)]
    engine = make_engine(model, lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=12, prefix_cache=True,
                         drafter=NgramDrafter(4))
    results = engine.generate(requests[:1]) + engine.generate(requests[1:])
    assert sum(r.proposed for r in results) > sum(r.accepted for r in results) > 0
    assert sum(r.reused for r in results) > 0
    for request, got in zip(requests, results):
        assert (got.ids, got.digests) == cold(model, request)
    assert all_back(engine)


def test_control_pages_computed_under_partial_reused_by_rows_streams_come_out_red(model):
    """The key names the arithmetic because the bits depend on it: reuse a page across arithmetics (here by
    flipping the engine's policy under one key) and the warm reply changes."""
    vocab = model.config.vocab_size
    system = tokens(420, 8, vocab)  # rows past the first 256 keys, where partial and rows differ, in full pages
    first, second = (Request(tuple(system + tokens(20, s, vocab)), max_tokens=6) for s in (1, 2))
    switch = ColdPartial()  # `partial` for the cold run, `rows` after
    engine = make_engine(model, lanes=1, page_rows=KEY_TILE, paged_all=True, pool_pages=8, prefix_cache=True,
                         arithmetic=switch)
    engine.generate([first])
    switch.warm()
    warm = engine.generate([second])[0]
    assert warm.reused == 6 * KEY_TILE
    assert warm.digests != cold(model, second)[1]  # RED


def test_the_n_choices_of_one_request_share_their_prompt(model):
    """Choices added together: the others wait one chunk for the first to name the prompt's pages, then map them."""
    from tfq.engine.stream import choices

    vocab = model.config.vocab_size
    requests = choices([tokens(200, 12, vocab)], 3, seed=4, max_tokens=6, temperature=0.9)
    engine = make_engine(model, lanes=3, page_rows=KEY_TILE, paged_all=True, pool_pages=24, prefix_cache=True)
    results = engine.generate(requests)
    assert [r.reused for r in results] == [0, 3 * KEY_TILE, 3 * KEY_TILE]
    for request, got in zip(requests, results):
        assert (got.ids, got.digests) == cold(model, request)
    assert all_back(engine)


def test_tfq_chat_reports_the_rows_reused(tiny_dirs, monkeypatch, capsys):
    from pathlib import Path

    from cli import tfq
    from tiny import CORPUS

    plan = str(Path(__file__).parent.parent / "plans" / "tiny.yaml")
    shared = CORPUS[:600]
    code, out, err = tfq(["chat", "--model", str(tiny_dirs["qwen2"]), "--plan", plan, "--quiet", "--max-tokens", "4",
                          "--set", "kv.paged=all", "--set", "kv.prefix_cache=on",
                          "-p", shared + " first?", "-p", shared + " second?"], monkeypatch, capsys)
    assert code == 0 and out.count("=== ") == 2
    assert re.search(r"prefix cache: [1-9]\d* rows reused", err)
