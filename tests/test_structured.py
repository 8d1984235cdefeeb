"""Structured outputs and penalties: each a function of a stream's own row and tokens, so a constrained or
penalized reply is the same alone or together, paged, preempted or drafted; a mask built from the batch (the
control) is not. The shipped schema suite (examples/schemas.json) on the default model: every reply valid."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engines import engine, one_by_one, same
from test_draft import RandomDrafter
from tfq.decode.grammar import Constraint, SharedMask, constraint_of
from tfq.decode.penalties import Penalties
from tfq.decode.sampling import log_softmax, logprob
from tfq.engine.stream import Finish, Request
from tfq.errors import TfqError
from unit.test_structured import PENALIZED

SCHEMAS = json.loads((Path(__file__).parent.parent / "examples" / "schemas.json").read_text())["schemas"]


def shaped_requests(tok) -> list[Request]:
    """Constrained and penalized requests on the tiny model, greedy and sampled, short and long prompts."""
    prompts = [tuple(tok.chat_ids([{"role": "user", "content": text}]))
               for text in ("json please", "a date: " * 12, "pick one", "def fibonacci(n):" * 9)]
    shapes = [dict(constraint=Constraint("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}")),
              dict(penalties=PENALIZED),
              dict(constraint=Constraint("choice", json.dumps(["alpha", "beta", "gamma"]))),
              dict(constraint=Constraint.json_schema({"type": "array", "items": {"enum": ["a", "b"]}}),
                   penalties=Penalties(frequency=1.0))]
    return [Request(p, max_tokens=20, temperature=t, seed=5, logprobs=2, **shape)
            for p, shape in zip(prompts, shapes) for t in (0.0, 0.9)]


def tiny_engine(loaded, **kw):
    return engine(loaded.model, tokenizer=loaded.tokenizer, eos_ids=loaded.tokenizer.eos_ids, keep_logits=True, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def alone(tiny):
    return one_by_one(tiny_engine(tiny), shaped_requests(tiny.tokenizer))


def test_constrained_and_penalized_replies_equal_alone_together_paged_preempted_and_drafted(tiny, alone):
    requests = shaped_requests(tiny.tokenizer)
    busy = tiny_engine(tiny, lanes=4, prefill_chunk=16, page_rows=64, paged_all=True, pool_pages=5,
                       page_order_seed=2)
    together = busy.generate(requests)
    assert sum(r.preempted for r in together) > 0  # the case is preemption, by construction
    drafted = tiny_engine(tiny, lanes=3, drafter=RandomDrafter(3, tiny.config.vocab_size, 1)).generate(requests)
    for a, b, c in zip(alone, together, drafted):
        assert same(a, b) and same(a, c)
        assert a.logprobs == b.logprobs == c.logprobs
    assert {r.text for r in alone[4:6]} <= {"alpha", "beta", "gamma"}
    assert all(len(r.text) == 10 and r.text[4] == "-" for r in alone[:2] if r.finish is Finish.EOS)


def test_control_one_mask_buffer_for_the_batch_comes_out_red(tiny, alone):
    """The control: every row's mask or-ed into one buffer never cleared (a batch's mask shared across rows);
    then some row may draw what only another row's grammar allows, and a reply parts from its run alone."""
    requests = shaped_requests(tiny.tokenizer)
    control = tiny_engine(tiny, lanes=4, mask=SharedMask()).generate(requests)
    assert any(not same(a, c) for a, c in zip(alone, control))


def test_log_probabilities_are_the_models_not_the_masked_rows(tiny, alone):
    """A constrained token's log-probability is the model's (the row before the grammar's mask), as the same
    token's score without any constraint; the masked row's log-softmax (the control) gives other numbers."""
    r = alone[0]  # a regex: most of the vocabulary masked
    assert [s.logprob for s in r.logprobs] == [logprob(row, t).logprob for row, t in zip(r.logits, r.ids)]
    masked = tiny_engine(tiny)
    st_request = shaped_requests(tiny.tokenizer)[0]
    matcher = masked.grammars.matcher(st_request.constraint)
    allowed = torch.from_numpy(matcher.allowed())
    row = torch.where(allowed, r.logits[0], float("-inf"))
    assert float(log_softmax(row)[r.ids[0]]) != r.logprobs[0].logprob  # control


def test_a_matcher_is_a_function_of_the_reply(tiny):
    """A matcher moved to another reply (a stream recomputed, a reply continued elsewhere) begins again from
    its tokens: its mask equals a fresh matcher's at that reply. With a drafter, a probe of its own checks the
    guesses; without one there is nothing to check."""
    grammars = tiny_engine(tiny, drafter=RandomDrafter(3, tiny.config.vocab_size, 1)).grammars
    constraint = Constraint("choice", json.dumps(["alpha", "beta"]))
    tok = tiny.tokenizer
    a, b = tok.encode("alpha"), tok.encode("beta")
    moved = grammars.matcher(constraint)
    moved.at(a[:1])
    moved.at(b[:1])  # not an extension of what it consumed
    fresh = grammars.matcher(constraint)
    fresh.at(b[:1])
    assert np.array_equal(moved.allowed(), fresh.allowed())
    assert moved.valid_prefix(b[:1], b[1:] + a) == len(b) - 1  # a drafter's guesses: those the grammar takes
    assert tiny_engine(tiny).grammars.matcher(constraint).valid_prefix(b[:1], b[1:]) == 0


def test_bad_constraints_are_one_line_refusals(tiny):
    with pytest.raises(TfqError, match="one constraint at most"):
        constraint_of(json_schema={"type": "object"}, regex="a+")
    with pytest.raises(TfqError, match="non-empty list"):
        constraint_of(choice=[])
    eng = tiny_engine(tiny)
    unsatisfiable = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
                     "additionalProperties": False}
    r = eng.generate([Request((1, 2, 3), max_tokens=4, constraint=Constraint.json_schema(unsatisfiable))])[0]
    assert r.finish is Finish.ERROR and "cannot be used" in r.error and "\n" not in r.error and not r.ids
    with pytest.raises(TfqError, match="logit_bias"):
        Request((1,), penalties=Penalties(bias=((3, 500.0),))).validate()
    with pytest.raises(TfqError, match="token ids are in"):  # a token the model lacks: refused before it runs
        eng.add(Request((1,), penalties=Penalties(bias=((tiny.config.vocab_size, 1.0),))))


@pytest.mark.slow
def test_every_schema_of_the_suite_gives_a_valid_reply_the_same_alone_and_eight_at_a_time(default_model):
    """examples/schemas.json (34 schemas: nested objects, arrays, enums, bounds, optional fields, $ref, anyOf,
    oneOf, allOf) on the default model, greedy and sampled: every reply ends and is valid against its schema
    (jsonschema), and equals its run alone, ids and logits bits. The control (one mask buffer for the batch)
    parts from the runs alone."""
    import jsonschema

    tok = default_model.tokenizer
    system = {"role": "system", "content": "Reply with JSON only."}
    requests = [Request(tuple(tok.chat_ids([system, {"role": "user", "content": s["prompt"]}])), max_tokens=96,
                        temperature=0.7 if i % 3 == 2 else 0.0, seed=i, label=s["name"],
                        constraint=Constraint.json_schema(s["schema"])) for i, s in enumerate(SCHEMAS)]
    assert len(requests) >= 30
    alone = one_by_one(tiny_engine(default_model), requests)
    together = tiny_engine(default_model, lanes=8).generate(requests)
    for s, a, b in zip(SCHEMAS, alone, together):
        assert a.finish is Finish.EOS, (s["name"], a.finish, a.text)
        jsonschema.validate(json.loads(a.text), s["schema"])
        assert same(a, b), s["name"]
    control = tiny_engine(default_model, lanes=8, mask=SharedMask()).generate(requests)
    assert sum(not same(a, c) for a, c in zip(alone, control)) > len(requests) // 2


def test_the_server_takes_response_format_structured_outputs_and_penalties(tiny_dirs, tiny_models):
    """Through the `openai` client: a json_schema reply follows its schema, streamed or not (the same reply);
    vLLM's structured_outputs (a regex) and repetition_penalty; OpenAI's penalties and logit_bias. A schema
    that cannot be satisfied, a bias on a token the model lacks, a key that is not a token id: 400, naming
    the field."""
    from openai import BadRequestError, OpenAI

    from served import NAME, server, tiny_served
    from tfq.serve.background import serving

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw = dict(model=NAME, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=30, temperature=0.8,
              seed=3, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"17": 5})
    with serving(server(tiny_served(tiny_dirs, tiny_models))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(response_format=fmt, extra_body={"repetition_penalty": 1.2}, **kw)
        chunks = client.chat.completions.create(response_format=fmt, extra_body={"repetition_penalty": 1.2},
                                                stream=True, **kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        regex = client.completions.create(model=NAME, prompt="when?", max_tokens=16, temperature=0,
                                          extra_body={"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
        refusals = {}
        for field, body in (("response_format", {"response_format": {"type": "json_schema", "json_schema": {
                                "name": "x", "schema": {"type": "object", "required": ["a"],
                                                        "additionalProperties": False}}}}),
                            ("logit_bias", {"logit_bias": {str(tiny_models["qwen2"].config.vocab_size): 1}}),
                            ("logit_bias", {"logit_bias": {"x": 1}})):
            with pytest.raises(BadRequestError) as e:
                client.chat.completions.create(**{**kw, **body})
            refusals[json.dumps(body)] = e.value.body["param"] == field and "\n" not in e.value.body["message"]
    assert json.loads(whole.choices[0].message.content) in ({"answer": "yes"}, {"answer": "no"})
    assert streamed == whole.choices[0].message.content
    assert len(regex.choices[0].text) == 5 and regex.choices[0].text[2] == ":"
    assert all(refusals.values()), refusals
