"""A thinking model's reply apart (tfq/decode/thinking.py): thinking and answer from the whole text and from any
pieces it streams in, tool calls found in the thinking and after it, and the server's chat choice and chunks built
from them. No model here (tests/test_thinking.py serves one)."""
from __future__ import annotations

import json

import pytest

from tfq.decode.thinking import ThinkStream, calls_in, opened, split, thinks
from tfq.engine.stream import Finish, Result
from tfq.serve.replies import ChoiceStream, Shape, chat_choice


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


CASES = [  # (reply, whether the prompt opened the block) -> (thinking, answer)
    (("<think>\nlet me see\n</think>\n\nThe answer.", False), ("\nlet me see\n", "The answer.")),
    (("let me see</think>\n\nThe answer.", True), ("let me see", "The answer.")),
    (("<think>\n\n</think>\n\nno thoughts", False), ("\n\n", "no thoughts")),  # /no_think's empty block
    (("Plain answer, no block.", False), ("", "Plain answer, no block.")),
    (("  <think>cut off by the budget", False), ("cut off by the budget", "")),
    (("still thinking when the budget ran out", True), ("still thinking when the budget ran out", "")),
    (("<thinking is not the tag", False), ("", "<thinking is not the tag")),
    (("a < b and </thin", True), ("a < b and </thin", "")),
    (("<think>x</think>", False), ("x", "")),
]


@pytest.mark.parametrize("reply, want", CASES)
def test_a_reply_splits_into_thinking_and_answer_whole_or_piece_by_piece(reply, want):
    text, inside = reply
    assert split(text, inside) == want
    for cut in range(len(text) + 1):  # every way of streaming it in two pieces, then one character at a time
        stream = ThinkStream(inside)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, cut
    stream = ThinkStream(inside)
    parts = [stream.feed(c) for c in text] + [stream.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want


def test_templates_that_think_and_prompts_that_open_the_block():
    assert thinks("{{- '<think>\\n' }}") and not thinks("{{- messages }}") and not thinks(None)
    assert opened("<|im_start|>assistant\n<think>\n") and not opened("<|im_start|>assistant\n")
    assert not opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_calls_are_found_in_the_thinking():
    thinking = f"first {call('look', q='a')} then {call('look', q='b')} and <tool_call>not json</tool_call>"
    assert [(c.name, json.loads(c.arguments)) for c in calls_in(thinking)] == [("look", {"q": "a"}),
                                                                              ("look", {"q": "b"})]
    assert calls_in("no calls") == []


REPLY = (f"<think>\nI should look it up. {call('look', q='tides')}\n</think>\n\n"
         f"{call('fetch', n=1)}\n{call('fetch', n=2)}")


def whole(shape: Shape) -> dict:
    return chat_choice(shape, None, 0, Result("", [1, 2], REPLY, ["a", "b"], Finish.EOS))


def test_the_chat_choice_has_the_thinking_apart_and_every_call():
    message = whole(Shape.new("chat", "m", tools=True, thinking=False))
    assert message["finish_reason"] == "tool_calls"
    m = message["message"]
    assert m["reasoning_content"].startswith("\nI should look it up.") and m["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == [
        ("look", {"q": "tides"}), ("fetch", {"n": 1}), ("fetch", {"n": 2})]
    plain = whole(Shape.new("chat", "m", thinking=False))["message"]  # no tools: the calls stay text
    assert "tool_calls" not in plain and plain["content"].startswith("<tool_call>")
    assert whole(Shape.new("chat", "m"))["message"] == {"role": "assistant", "content": REPLY}  # no thinking


@pytest.mark.parametrize("tools", [False, True])
def test_streamed_deltas_add_up_to_the_whole_choice(tools):
    shape = Shape.new("chat", "m", tools=tools, thinking=False)
    stream = ChoiceStream(shape)
    deltas = [stream.feed(REPLY[i:i + 3]) for i in range(0, len(REPLY), 3)] + [stream.finish()]
    want = whole(shape)["message"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want["reasoning_content"]
    assert ("".join(d.get("content") or "" for d in deltas) or None) == want["content"]
    got = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in got] == list(range(len(got)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want.get("tool_calls", [])]
