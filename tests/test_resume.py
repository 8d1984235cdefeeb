"""A reply resumed from the tokens another engine drew (Request.resumed: what the Ray ingress sends when a replica dies
mid-stream) goes on with the uninterrupted reply's bits: the same next tokens, logits digests, log-probabilities,
text and finish, greedy and sampled, with penalties and grammars, cut anywhere."""
from __future__ import annotations

import dataclasses

import pytest

from engines import one_by_one
from test_structured import shaped_requests, tiny_engine
from tfq.engine.stream import Request
from tfq.errors import TfqError


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["qwen2"]


def resumed_at(request: Request, whole, k: int) -> Request:
    return dataclasses.replace(request, resumed=tuple(whole.ids[:k]))


def test_a_resumed_reply_goes_on_with_the_uninterrupted_bits(tiny):
    requests = shaped_requests(tiny.tokenizer)
    whole = one_by_one(tiny_engine(tiny), requests)
    cuts = [(r, w, k) for r, w in zip(requests, whole) for k in sorted({1, len(w.ids) // 2, len(w.ids) - 1})
            if 0 < k < len(w.ids)]
    assert len(cuts) >= 2 * len(requests)
    # several resumed streams together in one engine, on pages: a replica going on with others' streams
    got = tiny_engine(tiny, lanes=4, page_rows=64, paged_all=True, pool_pages=16).generate(
        [resumed_at(r, w, k) for r, w, k in cuts])
    for (r, w, k), g in zip(cuts, got):
        assert g.ids == w.ids and g.text == w.text and g.finish == w.finish, (r.label, k)
        assert g.digests == w.digests[k:] and g.logprobs == w.logprobs[k:], (r.label, k)


def test_control_a_resumed_token_changed_parts_the_reply(tiny):
    """RED by construction: one resumed token other than the one drawn, the reply after it parts."""
    request = next(r for r in shaped_requests(tiny.tokenizer) if r.constraint is None and r.temperature == 0)
    whole = one_by_one(tiny_engine(tiny), [request])[0]
    k = len(whole.ids) // 2
    wrong = list(whole.ids[:k])
    wrong[-1] = (wrong[-1] + 1) % tiny.config.vocab_size
    got = tiny_engine(tiny).generate([dataclasses.replace(request, resumed=tuple(wrong))])[0]
    assert got.digests != whole.digests[k:]


def test_a_resume_with_nothing_left_to_draw_is_refused_in_one_line(tiny):
    request = shaped_requests(tiny.tokenizer)[0]
    with pytest.raises(TfqError, match="resume a reply that has not ended"):
        dataclasses.replace(request, resumed=(5,) * request.max_tokens).validate()
    out = tiny_engine(tiny).generate([dataclasses.replace(request, resumed=(tiny.config.vocab_size + 3,))])[0]
    assert out.error and "resumed token" in out.error
