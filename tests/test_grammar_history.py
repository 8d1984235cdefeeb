"""A constrained reply is a function of its own request, whatever the server compiled before it.

llguidance's compiled matcher caches the lexer states it builds, counted against `max_lexer_states`, and copies of
a matcher share that cache. tfq compiles a matcher for every stream (tfq/decode/grammar.py: OwnCompile), so the same
request gets the same reply on a fresh server and after 200 other constrained requests walked the same grammars.
The limit is lowered here so a few hundred walks would reach it; the control hands every stream a copy of one
compile (SharedCompile, what tfq did before) and its replies change with what came before (RED).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from served import NAME, idle, raw, server, tiny_served
from tfq.decode.grammar import LIMITS, OwnCompile, SharedCompile
from tfq.engine.core import Controls
from tfq.serve.background import serving

# every walk through this regex builds lexer states of its own (the last 17 letters' a's): hundreds of walks of a
# few dozen letters need thousands of states, one walk of 24 about a hundred
LEXER_HEAVY = "(a|b)*a(a|b){16}"
SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(a|b)*a(a|b){8}$"},
                                           "tag": {"type": "string", "pattern": "^[ab]{3,12}$"}},
          "required": ["code", "tag"], "additionalProperties": False}
LOW = tuple((k, 500 if k == "max_lexer_states" else v) for k, v in LIMITS)
OTHERS = 200


def ask(base: str, eos: list[int], seed: int, n: int, max_tokens: int, regex: str | None = None,
        schema: dict | None = None) -> tuple[int, dict]:
    constraint = {"structured_outputs": {"regex": regex}} if regex else \
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    status, _, body = raw(base, "POST", "/v1/chat/completions", json.dumps({
        "model": NAME, "messages": [{"role": "user", "content": "a and b"}], "n": n, "seed": seed,
        "temperature": 1.0, "max_tokens": max_tokens, "return_token_ids": True, "return_digests": True,
        "logit_bias": {str(t): -100 for t in eos},  # no early end: every walk runs its whole length
        **constraint}).encode())
    return status, json.loads(body)


def replies(status: int, body: dict) -> tuple[int, list | str]:
    """What is compared of an answer: every choice's token ids, digests and finish, or the error."""
    if status != 200:
        return status, body["error"]["message"]
    return status, [(c["token_ids"], c["digests"], c["finish_reason"]) for c in body["choices"]]


def targets(base: str, eos: list[int]) -> list:
    """The requests compared: a lexer-heavy regex and a schema with patterns, 16 choices each."""
    return [replies(*ask(base, eos, 7, 16, 24, regex=LEXER_HEAVY)), replies(*ask(base, eos, 8, 16, 24, schema=SCHEMA))]


def others(base: str, eos: list[int]) -> list[int]:
    """200 other constrained requests (other walks through the same grammars, and other grammars): their statuses."""
    def one(k: int) -> int:
        if k % 4 == 3:
            return ask(base, eos, 1000 + k, 1, 16, regex=f"[ab]{{{1 + k % 7}}}(a|b)*b(a|b){{{4 + k % 9}}}")[0]
        return ask(base, eos, 1000 + k, 1, 16, **({"regex": LEXER_HEAVY} if k % 2 else {"schema": SCHEMA}))[0]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(OTHERS)))


def before_and_after(tiny, compile_) -> tuple[list, list[int], list]:
    """The targets on a fresh server, the others' statuses, the targets again."""
    served = server(tiny, controls=Controls(compile=compile_))
    eos = sorted(served.tokenizer.eos_ids)
    with serving(served) as base:
        fresh = targets(base, eos)
        statuses = others(base, eos)
        again = targets(base, eos)
        idle(base)
    return fresh, statuses, again


@pytest.fixture(scope="module", params=["none", "ngram"], ids=["alone", "drafted"])
def tiny(request, tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models, sets=[f"draft={request.param}"])


@pytest.fixture(scope="module")
def own(tiny):
    return before_and_after(tiny, OwnCompile(LOW))


def test_a_constrained_reply_is_the_same_after_200_other_constrained_requests(own):
    fresh, statuses, again = own
    assert all(s == 200 for s in statuses)
    assert all(status == 200 for status, _ in fresh)
    assert all(finish == "length" and len(ids) == 24 for _, target in fresh for ids, _, finish in target)
    assert fresh == again  # ids, digests and finish of every choice


def test_the_control_copies_of_one_compile_depend_on_what_came_before(tiny, own):
    _, _, again = before_and_after(tiny, SharedCompile(LOW))
    assert again != own[0]  # RED: the shared lexer's states ran out on the requests before
