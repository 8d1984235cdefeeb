"""A reply resumed from the tokens another engine drew (Request.resumed: what the Ray ingress sends when a replica dies
mid-stream) goes on with the uninterrupted reply's bits: the same next tokens, logits digests, log-probabilities,
text and finish, greedy and sampled, with penalties and grammars, cut anywhere."""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json

import pytest

from engines import one_by_one
from serve_load import EXTRA, Call, fire
from served import NAME, server, tiny_served
from test_structured import shaped_requests, tiny_engine
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.serve.background import serving


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


@pytest.mark.parametrize("extra, words", [
    ({"stream": False}, "set stream to true"),
    ({"n": 2}, "give one prompt, n = 1"),
    ({"receipt": True}, "leave receipt out"),
    ({"resume_token_ids": [10 ** 6]}, "token ids in [0,"),
    ({"resume_token_ids": [5] * 600}, "leave no room in the window"),
])
def test_a_resume_the_server_cannot_go_on_with_is_a_400_in_one_line(tiny_dirs, tiny_models, extra, words):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "resume_token_ids": [5, 6], **extra}
    with serving(server(tiny_served(tiny_dirs, tiny_models))) as base:
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 400 and words in json.loads(r.read())["error"]["message"]


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_resumed_through_the_server_sends_the_uninterrupted_streams_tail(tiny_dirs, tiny_models, chat):
    """What the Ray ingress relies on: a streamed reply sent again with its first k tokens as resume_token_ids
    streams exactly the rest of the uninterrupted reply (ids, log-probabilities, digests, finish)."""
    text = "The quick brown fox jumps over the lazy dog. " * 3
    body = {"max_tokens": 40, "temperature": 0.8, "seed": 3, "extra_body": EXTRA,
            **({"messages": [{"role": "user", "content": text}], "logprobs": True, "top_logprobs": 2} if chat else
               {"prompt": text, "logprobs": 2})}
    call = Call("resumed", chat, True, 0.0, body)
    with serving(server(tiny_served(tiny_dirs, tiny_models))) as base:
        whole = asyncio.run(fire(base, NAME, [call]))[0][0]
        k = len(whole["ids"]) // 2
        later = dataclasses.replace(call, body={**body, "extra_body": {**EXTRA, "resume_token_ids": whole["ids"][:k]}})
        rest = asyncio.run(fire(base, NAME, [later]))[0][0]
    assert 0 < k < len(whole["ids"])
    assert rest["ids"] == whole["ids"][k:] and rest["digests"] == whole["digests"][k:]
    assert rest["logprobs"] == whole["logprobs"][k:] and rest["finish"] == whole["finish"]
