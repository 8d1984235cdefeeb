"""The server's request bodies without a server: tfq/serve/protocol.py's pydantic models validate a body as the
routes do (FastAPI validates the parsed JSON), and tfq/serve/intake.py's validation_message turns the first
complaint into the one line the client reads. Each refusal beside the body just inside its bound (the control);
tests/test_hostile.py sends the same kinds of bodies to a running server."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tfq.decode.penalties import MOST_BIASED
from tfq.serve.intake import validation_message
from tfq.serve.protocol import MOST_CHOICES, ChatBody, CompletionBody

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def refusal(model, body) -> tuple[str, str | None]:
    """(message, param) of a refused body; fails the test if the body is taken."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    message, param = validation_message(e.value.errors())
    assert message and "\n" not in message
    return message, param


# (name, model, refused body, what its message holds, the same field just inside the bound: taken)
BOUNDS = [
    ("logit_bias of 301 tokens", ChatBody, {**CHAT, "logit_bias": {str(t): 1 for t in range(MOST_BIASED + 1)}},
     "logit_bias", {**CHAT, "logit_bias": {str(t): 1 for t in range(MOST_BIASED)}}),
    ("logit_bias keyed by a superscript digit", ChatBody, {**CHAT, "logit_bias": {"\u00b2": 1}},
     "logit_bias: Value error, keys are token ids written as ASCII digits", {**CHAT, "logit_bias": {"2": 1}}),
    ("logit_bias naming a token twice", ChatBody, {**CHAT, "logit_bias": {"7": 1, "007": -1}},
     "'7' and '007' name the same token", {**CHAT, "logit_bias": {"7": 1, "8": -1}}),
    ("logit_bias past its bound", ChatBody, {**CHAT, "logit_bias": {"7": 100.5}}, "token 7: a bias is in",
     {**CHAT, "logit_bias": {"7": 100}}),
    ("n 17", ChatBody, {**CHAT, "n": MOST_CHOICES + 1}, "n:", {**CHAT, "n": MOST_CHOICES}),
    ("seed 2**64", ChatBody, {**CHAT, "seed": 2 ** 64}, "seed:", {**CHAT, "seed": 2 ** 64 - 1}),
    ("temperature 2.0000001", ChatBody, {**CHAT, "temperature": 2.0000001}, "temperature:",
     {**CHAT, "temperature": 2.0}),
    ("temperature NaN", ChatBody, json.loads('{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                             '"temperature": NaN}'), "temperature:", {**CHAT, "temperature": 0.0}),
    ("top_p 0", ChatBody, {**CHAT, "top_p": 0.0}, "top_p:", {**CHAT, "top_p": 5e-324}),
    ("max_tokens a string", ChatBody, {**CHAT, "max_tokens": "10"}, "max_tokens:", {**CHAT, "max_tokens": 10}),
    ("max_tokens true", ChatBody, {**CHAT, "max_tokens": True}, "max_tokens:", {**CHAT, "max_tokens": 1}),
    ("five stop strings", ChatBody, {**CHAT, "stop": list("abcde")}, "stop:", {**CHAT, "stop": list("abcd")}),
    ("a typo of a field", ChatBody, {**CHAT, "temprature": 0.5}, "unknown field 'temprature'",
     {**CHAT, "temperature": 0.5}),
    ("top_logprobs without logprobs", ChatBody, {**CHAT, "top_logprobs": 3}, "set logprobs to true",
     {**CHAT, "top_logprobs": 3, "logprobs": True}),
    ("no messages", ChatBody, {**CHAT, "messages": []}, "messages:", CHAT),
    ("a tool's message with tool_calls", ChatBody, {**CHAT, "messages": [
        {"role": "tool", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]},
     "only an assistant message carries tool_calls", {**CHAT, "messages": [
         {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]}),
    ("a lone surrogate in content", ChatBody, json.loads('{"model": "tiny", "messages": [{"role": "user", '
                                                         '"content": "a\\ud800b"}]}'),
     "a lone UTF-16 surrogate is not text", json.loads('{"model": "tiny", "messages": [{"role": "user", '
                                                       '"content": "a\\ud83d\\ude00b"}]}')),
    ("an empty prompt", CompletionBody, {**TEXT, "prompt": ""}, "give a non-empty prompt", TEXT),
    ("a suffix", CompletionBody, {**TEXT, "suffix": "end"}, "suffix: tfq does not insert suffixes",
     {**TEXT, "suffix": ""}),
    ("best_of other than n", CompletionBody, {**TEXT, "n": 2, "best_of": 3}, "best_of:",
     {**TEXT, "n": 2, "best_of": 2}),
    ("no prompt", CompletionBody, {"model": "tiny"}, "prompt is required", TEXT),
]


@pytest.mark.parametrize("model, body, words, inside", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_a_body_past_a_bound_is_refused_in_one_line_naming_its_field(model, body, words, inside):
    message, _ = refusal(model, body)
    assert words in message, message
    model.model_validate(inside)  # the control: just inside the bound, taken


def test_the_param_is_the_field():
    assert refusal(ChatBody, {**CHAT, "logit_bias": {str(t): 1 for t in range(301)}})[1] == "logit_bias"
    assert refusal(ChatBody, {**CHAT, "temprature": 1})[1] == "temprature"


def test_a_taken_body_becomes_its_requests():
    """n choices of each prompt, seeds one a choice, the penalties' bias as (id, value) pairs by id, the stops,
    and without max_tokens a reply that may fill the window."""
    body = CompletionBody.model_validate({**TEXT, "n": 3, "seed": 5, "logit_bias": {"9": -1, "007": 2},
                                          "stop": "x", "max_tokens": None, "temperature": 0.5})
    requests = body.requests([[1, 2, 3], [4, 5]], window=64, max_tokens=None, logprobs=None)
    assert [r.prompt for r in requests] == [(1, 2, 3)] * 3 + [(4, 5)] * 3
    assert [r.max_tokens for r in requests] == [61] * 3 + [62] * 3
    assert len({r.seed for r in requests[:3]}) == 3 and [r.seed for r in requests[:3]] == [r.seed for r in requests[3:]]
    assert all(r.penalties.bias == ((7, 2.0), (9, -1.0)) and r.stop == ("x",) and r.temperature == 0.5
               for r in requests)


def test_chat_defaults_are_openais_but_the_seed():
    body = ChatBody.model_validate(CHAT)
    assert (body.temperature, body.top_p, body.n, body.seed) == (1.0, 1.0, 1, 0)
    assert body.reply_tokens == 2 and not body.calling and body.constraint is None
    assert ChatBody.model_validate({**CHAT, "max_completion_tokens": 7}).reply_tokens == 7
    assert ChatBody.model_validate({**CHAT, "messages": [{"role": "developer", "content": "d"}]}).chat() == [
        {"role": "system", "content": "d"}]  # OpenAI's developer is the template's system
