"""`POST /v1/responses` through the official `openai` client (`client.responses.create` and its streaming helper):
plain, streamed, with a tool, with a JSON schema, and continued by previous_response_id, each reply the chat API's
reply for the same conversation; a thinking model's thinking as a reasoning item; refusals in one line. On a tiny
model, and on the default model (slow)."""
from __future__ import annotations

import json

import pytest

from served import NAME, TINY_PLAN, server, tiny_served
from tfq.plan.resolve import resolve_plan
from tfq.serve.background import build_served, serving
from tiny import SHAPES

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def compare_with_chat(base: str, model: str) -> None:
    """Each form of a Responses request against the chat completion of the same conversation."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    chat = client.chat.completions.create
    common = dict(model=model, temperature=0)
    question = "Name a colour and say why you like it."

    plain = client.responses.create(input=question, instructions="Answer briefly.", max_output_tokens=24, **common)
    want = chat(messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}],
                max_tokens=24, **common).choices[0].message.content
    assert plain.output_text == want and plain.status in ("completed", "incomplete")
    assert plain.usage.output_tokens > 0 and plain.output[0].type == "message"

    deltas = []
    with client.responses.stream(input=question, instructions="Answer briefly.", max_output_tokens=24,
                                 **common) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == plain.output_text

    tool = [{"type": "function", "name": "weather", "description": "the weather in a city", "parameters": WEATHER}]
    called = client.responses.create(input="What is the weather in Oslo?", tools=tool, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=200, **common)
    chat_call = chat(messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[
        {"type": "function", "function": {k: v for k, v in tool[0].items() if k != "type"}}],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, **common).choices[0].message.tool_calls[0]
    call = next(o for o in called.output if o.type == "function_call")
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)
    assert json.loads(call.arguments)["city"] in ("Oslo", "Lima")

    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    shaped = client.responses.create(input="Is the sea salty?", text={"format": fmt}, max_output_tokens=120,
                                    **common)
    chat_shaped = chat(messages=[{"role": "user", "content": "Is the sea salty?"}], max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}, **common)
    assert shaped.output_text == chat_shaped.choices[0].message.content
    assert json.loads(shaped.output_text)["answer"] in ("yes", "no")

    then = client.responses.create(input="And another one?", previous_response_id=plain.id, max_output_tokens=16,
                                   **common)
    # the earlier request's instructions do not carry over (OpenAI's rule): its input and reply do
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": plain.output_text},
               {"role": "user", "content": "And another one?"}]
    assert then.output_text == chat(messages=history, max_tokens=16, **common).choices[0].message.content


def test_responses_equal_the_chat_api_on_a_tiny_model(tiny_dirs, tiny_models):
    with serving(server(tiny_served(tiny_dirs, tiny_models))) as base:
        compare_with_chat(base, NAME)


def test_responses_refusals_are_one_line(tiny_dirs, tiny_models):
    from openai import BadRequestError, OpenAI

    with serving(server(tiny_served(tiny_dirs, tiny_models))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        for kw, words in ((dict(input="hi", previous_response_id="resp_nowhere"), "no response 'resp_nowhere' is kept"),
                          (dict(input=[{"type": "web_search_call"}]), "items of type 'web_search_call'"),
                          (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                           "tfq serves text only"),
                          (dict(input="hi", temperature=5), "temperature")):
            with pytest.raises(BadRequestError) as e:
                client.responses.create(model=NAME, **kw)
            assert words in e.value.body["message"] and "\n" not in e.value.body["message"], e.value.body


def test_a_thinking_models_thinking_is_a_reasoning_item(thinker):
    """A tiny thinking model (tests/test_thinking.py), held to a thinking reply by a grammar: streamed or not, the
    thinking is the reasoning item's text and the answer the message's, as the chat API splits them."""
    from openai import OpenAI

    family, folder, loaded = thinker
    plan, _, layout = resolve_plan(TINY_PLAN, str(folder), [], True, None)
    shape = {"structured_outputs": {"regex": SHAPES[family]}}
    with serving(build_served(plan, layout, loaded, "thinker")) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        kw = dict(model="thinker", max_output_tokens=60, temperature=0, extra_body=shape)
        whole = client.responses.create(input="why is the sea salty", **kw)
        thought = []
        with client.responses.stream(input="why is the sea salty", **kw) as stream:
            for event in stream:
                if event.type == "response.reasoning_text.delta":
                    thought.append(event.delta)
            streamed = stream.get_final_response()
        chat = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content":
                                              "why is the sea salty"}], max_tokens=60, temperature=0,
                                              extra_body=shape).choices[0].message.model_dump()
    for r in (whole, streamed):
        kinds = [o.type for o in r.output]
        assert kinds == ["reasoning", "message"], kinds
        assert r.output[0].content[0].text == chat["reasoning_content"] and r.output_text == chat["content"]
    assert "".join(thought) == chat["reasoning_content"]


@pytest.mark.slow
def test_responses_equal_the_chat_api_on_the_default_model(default_model):
    plan, _, layout = resolve_plan(None, None, ["window=1024", "lanes=2"], True, None)
    with serving(build_served(plan, layout, default_model, "default")) as base:
        compare_with_chat(base, "default")
