"""Tool calls through the `openai` client: Qwen's `<tool_call>` blocks parsed into `tool_calls`, streamed as
whole calls, `tool_choice` "required" and named ones held to a grammar of the tools' parameters, `role: tool`
results going back in; the calls are the same alone and under load."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from served import NAME, server, tiny_served
from tfq.decode.tools import CLOSE, OPEN, CallStream, parse
from tfq.serve.background import ServeOptions, build_served, serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish_reason) of a streamed chat, assembled from its deltas as a client does."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                calls[c.index] = (c.function.name, json.loads(c.function.arguments))
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_a_reply_is_split_into_text_and_calls_the_same_whole_or_streamed():
    text = (f'Let me look.\n{OPEN}\n{{"name": "f", "arguments": {{"a": [1, 2]}}}}\n{CLOSE}\n'
            f'{OPEN}\n{{"name": "g", "arguments": {{}}}}\n{CLOSE}')
    head, calls = parse(text)
    assert head == "Let me look.\n" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, 2]}'), ("g", "{}")]
    for cut in (1, 2, 5, 11, len(text)):
        split, got, out = CallStream(), "", []
        for i in range(0, len(text), cut):
            piece, made = split.feed(text[i:i + cut])
            got, out = got + piece, out + made
        assert got + split.finish() == head and [(c.name, c.arguments) for c in out] == [("f", '{"a": [1, 2]}'),
                                                                                           ("g", "{}")]
    assert parse(text + f"\n{OPEN}\n{{\"name\": \"h\", \"argu")[1][-1].name == "g"  # a block cut off: dropped
    blank = parse(text + "\n\n")
    assert blank[0] == head and [c.name for c in blank[1]] == ["f", "g"]
    split = CallStream()
    assert split.feed(text + "\n")[0] == head and split.finish() == ""  # blank lines after the calls: dropped
    for broken in (f"{OPEN}\n{{not json}}\n{CLOSE}", f"{OPEN}\n[1]\n{CLOSE}", text + " and more words"):
        assert parse(broken) == (broken, [])  # not a call: all text


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


def test_required_and_named_tool_choices_are_held_to_the_tools_parameters(tiny):
    """On a random model: "required" makes a call of one of the tools, a named choice a call of that tool,
    its arguments valid against the parameters; the streamed calls are the whole reply's; the replies are
    the same with five others running at once; a tool's result goes back in as `role: tool`."""
    from openai import OpenAI

    named = {"type": "function", "function": {"name": "get_time"}}
    asks = [dict(tool_choice=choice, temperature=t, seed=s, parallel_tool_calls=parallel)
            for choice in ("required", named) for t, s in ((0.0, 0), (1.0, 4), (1.0, 9)) for parallel in (False,)]
    with serving(server(tiny)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

        def ask(kw):
            return client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, **kw)

        alone = [ask(kw) for kw in asks]
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(ask, asks))
        streams = [streamed(client, model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, **kw) for kw in asks]
        plain = ask(dict(tool_choice="none", temperature=0.0))  # no grammar, nothing parsed
        first = alone[0].choices[0].message.tool_calls[0]
        back = client.chat.completions.create(model=NAME, max_tokens=8, tools=TOOLS, messages=ASK + [
            {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
            {"role": "tool", "tool_call_id": first.id, "content": '{"sky": "clear"}'}])
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for kw, a, b, (content, calls, reason) in zip(asks, alone, together, streams):
        got = calls_of(a.choices[0].message)
        assert len(got) == 1 and a.choices[0].finish_reason == "tool_calls", a.choices[0]
        name, arguments = got[0]
        assert kw["tool_choice"] == "required" or name == "get_time"
        jsonschema.validate(arguments, params[name])
        assert calls_of(b.choices[0].message) == got and (calls, reason) == (got, "tool_calls")
    assert back.choices[0].finish_reason in ("stop", "length")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools with response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(tiny, body, field):
    from openai import BadRequestError, OpenAI

    with serving(server(tiny)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(**{"model": NAME, "messages": ASK, "max_tokens": 4, **body})
    assert field in f"{e.value.body['param']} {e.value.body['message']}" and "\n" not in e.value.body["message"]


@pytest.mark.slow
def test_a_two_turn_conversation_with_a_tool_on_the_default_model(default_model):
    """The default model lists the tools in its template and writes `<tool_call>` tokens: turn one ("required")
    calls get_weather, turn two takes its result; each turn the same streamed or not, and alone or with
    three other conversations at once."""
    from openai import OpenAI

    from tfq.plan.resolve import resolve_plan

    plan, _, layout = resolve_plan(None, None, [], True, None)
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with serving(build_served(plan, layout, default_model, "default", ServeOptions(queue=64))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        turn = dict(model="default", tools=[weather], max_tokens=48, temperature=0)
        one = client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **turn)
        call = one.choices[0].message.tool_calls[0]
        again = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "cloudy"}'}]
        two = client.chat.completions.create(messages=again, **turn)
        others = [dict(messages=[{"role": "user", "content": f"Weather in {c}?"}], tool_choice="required")
                  for c in ("Oslo", "Lima", "Rome")]
        with ThreadPoolExecutor(4) as pool:
            loaded = list(pool.map(lambda kw: client.chat.completions.create(**turn, **kw), [
                dict(messages=ASK, tool_choice="required", parallel_tool_calls=False), *others]))
        first_streamed = streamed(client, messages=ASK, tool_choice="required", parallel_tool_calls=False, **turn)
        second_streamed = streamed(client, messages=again, **turn)
    assert calls_of(one.choices[0].message)[0][0] == "get_weather" and one.choices[0].finish_reason == "tool_calls"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert calls_of(loaded[0].choices[0].message) == calls_of(one.choices[0].message)
    assert first_streamed[1:] == (calls_of(one.choices[0].message), "tool_calls")
    assert two.choices[0].message.content and second_streamed[0] == two.choices[0].message.content


def test_the_python_api_and_the_cli_take_tools(tiny_dirs, tmp_path):
    """tfq.LLM.chat(tools=..., tool_choice=...) and `tfq chat --tools FILE --tool-choice NAME` hold the reply to
    one call of the named tool and list it; the same call both ways (one engine, one arithmetic)."""
    from test_chat import TINY_PLAN, tfq
    from tfq import LLM, SamplingParams

    named = {"type": "function", "function": {"name": "get_weather"}}
    llm = LLM(model=str(tiny_dirs["qwen2"]), plan=TINY_PLAN)
    out = llm.chat(ASK, SamplingParams(max_tokens=120), tools=TOOLS, tool_choice=named)[0].outputs[0]
    assert [c.name for c in out.tool_calls] == ["get_weather"] and out.text == ""
    jsonschema.validate(json.loads(out.tool_calls[0].arguments), WEATHER["function"]["parameters"])
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    r = tfq("chat", ASK[0]["content"], "--tools", str(path), "--tool-choice", "get_weather", "--model",
            str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--max-tokens", "120", "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"tool call: get_weather {out.tool_calls[0].arguments}" in r.stderr
    bad = tfq("chat", "hi", "--tools", str(path), "--tool-choice", "nope", "--model", str(tiny_dirs["qwen2"]),
              "--plan", TINY_PLAN, "--quiet")
    assert bad.returncode == 2 and "'nope'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
