"""Drafting: verify forwards keep exactly the tokens, and logits bits, of undrafted decoding."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines import WINDOW, run, run_on
from tfq.engine.core import EngineSettings
from tfq.engine.draft import ModelDrafter, NgramDrafter, lookup
from tfq.engine.stream import Request
from tfq.kernels.contract import KEY_TILE


class RandomDrafter:
    """Guesses random tokens: almost all rejected."""

    def __init__(self, k: int, vocab: int, seed: int):
        self.k, self.vocab, self.rng = k, vocab, random.Random(seed)

    def propose(self, streams, budgets):
        return [[self.rng.randrange(self.vocab) for _ in range(b)] for b in budgets]


class OracleDrafter(RandomDrafter):
    """Knows the undrafted reply and guesses it, spoiling one guess in `spoil`: mostly accepted."""

    def __init__(self, k, vocab, seed, replies: dict[tuple, list[int]], spoil: int):
        super().__init__(k, vocab, seed)
        self.replies, self.spoil = replies, spoil

    def propose(self, streams, budgets):
        out = []
        for s, b in zip(streams, budgets):
            full = list(s.request.prompt) + self.replies[s.request.prompt]
            guess = full[len(s.tokens):len(s.tokens) + b]
            if guess and self.spoil and self.rng.randrange(self.spoil) == 0:
                guess[self.rng.randrange(len(guess))] = self.rng.randrange(self.vocab)
            out.append(guess)
        return out


def make_requests(vocab, spec):
    g = torch.Generator().manual_seed(sum(n for n, _, _ in spec))
    out = []
    for n, t, temp in spec:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        ids = ids + ids[: n // 2]  # some repetition, so lookup finds matches
        out.append(Request(tuple(ids), max_tokens=t, temperature=temp, seed=n))
    return out


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request, tiny_models):
    return tiny_models[request.param].model


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drafted_equals_undrafted(model, data):
    vocab = model.config.vocab_size
    spec = data.draw(st.lists(st.tuples(st.integers(2, 150), st.integers(1, 24), st.sampled_from([0.0, 0.0, 0.9])),
                              min_size=1, max_size=5))
    requests = make_requests(vocab, spec)
    paged = data.draw(st.booleans())
    cfg = EngineSettings(window=WINDOW, lanes=data.draw(st.integers(1, 5)),
                         prefill_chunk=data.draw(st.integers(8, 200)),
                         page_rows=KEY_TILE if paged else 0, pool_pages=40 if paged else 0)
    plain = run(model, requests, lanes=len(requests))
    k = data.draw(st.integers(1, 8))
    kind = data.draw(st.sampled_from(["random", "oracle", "ngram"]))
    seed = data.draw(st.integers(0, 99))
    if kind == "random":
        drafter = RandomDrafter(k, vocab, seed)
    elif kind == "oracle":
        drafter = OracleDrafter(k, vocab, seed, {r.prompt: p.ids for r, p in zip(requests, plain)},
                                spoil=data.draw(st.integers(0, 4)))
    else:
        drafter = NgramDrafter(k)
    drafted = run(model, requests, cfg, drafter=drafter)
    for a, b in zip(plain, drafted):
        assert b.ids == a.ids and b.digests == a.digests
    if kind == "oracle" and drafter.spoil == 0 and any(len(p.ids) > 2 for p in plain):
        # the guesses were right, and some reply was long enough to guess at (a guess needs two tokens still to
        # draw: with one left, a verify could draw past the reply's end): fewer forwards than tokens
        assert sum(b.accepted for b in drafted) > 0


def test_oracle_saves_forwards_and_pages_roll_back(model):
    requests = make_requests(model.config.vocab_size, [(70, 30, 0.0), (40, 30, 0.0)])
    cfg = EngineSettings(window=WINDOW, lanes=2, page_rows=KEY_TILE, paged_all=True, pool_pages=20)
    plain, plain_engine = run_on(model, requests, cfg)
    oracle = OracleDrafter(6, model.config.vocab_size, 0, {r.prompt: p.ids for r, p in zip(requests, plain)}, 0)
    drafted, engine = run_on(model, requests, cfg, drafter=oracle)
    assert [d.ids for d in drafted] == [p.ids for p in plain]
    assert engine.forwards < plain_engine.forwards / 3
    assert len(engine.pages.free) == 20  # every page back, none leaked by rejected rows
    rnd = RandomDrafter(8, model.config.vocab_size, 1)
    rejected, engine = run_on(model, requests, cfg, drafter=rnd)
    assert [d.ids for d in rejected] == [p.ids for p in plain]
    assert sum(d.proposed for d in rejected) > 0 and len(engine.pages.free) == 20


def test_tiny_draft_model_stays_exact(tiny_models):
    target, draft = tiny_models["qwen2"], tiny_models["qwen3"]
    requests = make_requests(target.config.vocab_size, [(60, 20, 0.0), (90, 16, 0.7), (30, 25, 0.0)])
    cfg = EngineSettings(window=WINDOW, lanes=3, page_rows=KEY_TILE, pool_pages=30)
    plain = run(target.model, requests, cfg)
    drafted = run(target.model, requests, cfg, drafter=ModelDrafter(draft.model, lanes=3, window=WINDOW, k=4))
    for a, b in zip(plain, drafted):
        assert b.ids == a.ids and b.digests == a.digests
    assert sum(b.proposed for b in drafted) > 0


def test_self_draft_accepts_everything_greedy(tiny_models):
    """The target as its own drafter guesses right every time (greedy), so each forward yields k+1 tokens."""
    target = tiny_models["qwen2"]
    requests = make_requests(target.config.vocab_size, [(50, 21, 0.0)])
    cfg = EngineSettings(window=WINDOW, lanes=1)
    plain = run(target.model, requests, cfg)
    drafter = ModelDrafter(target.model, lanes=1, window=WINDOW, k=4)
    drafted, engine = run_on(target.model, requests, cfg, drafter=drafter)
    assert drafted[0].ids == plain[0].ids and drafted[0].digests == plain[0].digests
    assert drafted[0].accepted == drafted[0].proposed == 16
    assert engine.forwards == 1 + 4  # prefill draws 1, then four verifies of 4 guesses + 1


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 1, 2], 2, [3, 4]),
    ([1, 2, 3, 1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the latest earlier match wins
    ([5, 6, 7], 4, []),
    ([7, 7], 3, [7]),
])
def test_ngram_lookup(tokens, k, want):
    assert lookup(tokens, k) == want
