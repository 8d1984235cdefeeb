"""Thinking kept apart, on tiny random Qwen3 and Qwen3.5 checkpoints carrying a thinking chat template (Qwen3's
writes an empty closed block when thinking is off; Qwen3.5's opens the block in the prompt). A grammar holds each
reply to the shape a thinking model writes, so the random model thinks, answers and calls tools on cue. The server
returns the thinking in `reasoning_content`, streamed or not (the same text), and the answer in `content`;
`chat_template_kwargs: {"enable_thinking": false}` turns it off; replies under load equal their runs alone; `tfq.LLM`
and `tfq chat` keep the two apart too, and a call written in the thinking is found beside the two after it."""
from __future__ import annotations

import asyncio
import re

import pytest

from cli import tfq
from serve_load import EXTRA, Call, differences, fire
from served import TINY_PLAN, replies_alone
from tfq.plan.resolve import resolve_plan
from tfq.serve.background import build_served, serving
from tiny import SHAPES


def served(thinker):
    _, folder, loaded = thinker
    plan, _, layout = resolve_plan(TINY_PLAN, str(folder), [], True, None)
    return build_served(plan, layout, loaded, "thinker")


def body(family: str, text: str, off: bool = False, **kw) -> dict:
    extra = {"structured_outputs": {"regex": "[a-z ]{4,24}" if off else SHAPES[family]}, **EXTRA}
    if off:
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 60, "extra_body": extra, **kw}


def test_the_server_keeps_thinking_apart_streamed_or_not_and_off_on_request(thinker):
    from openai import OpenAI

    family = thinker[0]
    with serving(served(thinker)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(model="thinker", **body(family, "why is the sea salty"))
        chunks = list(client.chat.completions.create(model="thinker", stream=True,
                                                     **body(family, "why is the sea salty")))
        off = client.chat.completions.create(model="thinker", **body(family, "why is the sea salty", off=True))
        from openai import BadRequestError

        with pytest.raises(BadRequestError) as refused:  # a special token's variable is the tokenizer's own
            client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"chat_template_kwargs": {"eos_token": "<|im_start|>"}})
    m = whole.choices[0].message.model_dump()
    assert m["reasoning_content"] and m["content"] and "</think>" not in m["content"] + m["reasoning_content"]
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]
    o = off.choices[0].message.model_dump()
    assert o["reasoning_content"] is None and o["content"]
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens  # the template wrote the empty, closed block
    assert refused.value.body["param"] == "chat_template_kwargs" and "'eos_token'" in refused.value.body["message"]


def test_thinking_replies_under_load_equal_their_runs_alone(thinker):
    family = thinker[0]
    load = [Call(f"t{i}", True, i % 2 == 1, 0.05 * i, body(family, f"question number {i}", off=i % 3 == 2,
                                                               temperature=0.8 * (i % 2), seed=i))
            for i in range(8)]
    alone = replies_alone(lambda: served(thinker), "thinker", load)
    with serving(served(thinker)) as base:
        under = asyncio.run(fire(base, "thinker", load))
    assert differences(under, alone, load) == []


def test_llm_and_chat_keep_thinking_apart_and_find_calls_inside_it(thinker, monkeypatch, capsys):
    from tfq import LLM, SamplingParams

    family, folder, _ = thinker
    look = '<tool_call>\n{"name": "look", "arguments": {"q": "sea"}}\n</tool_call>'
    fetch = '<tool_call>\n{"name": "fetch", "arguments": {"n": 1}}\n</tool_call>'
    inside = f"[a-z ]{{4,12}}{re.escape(look)}[a-z ]{{1,8}}</think>\n\n{re.escape(fetch)}\n{re.escape(fetch)}"
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("look", "fetch")]
    llm = LLM(model=str(folder), plan=TINY_PLAN)
    out = llm.chat([{"role": "user", "content": "look it up"}], SamplingParams(
        max_tokens=400, regex=("<think>" if family == "qwen3" else "") + inside), tools=tools)[0].outputs[0]
    assert out.finish_reason == "eos" and out.reasoning and out.text == "", out
    assert [c.name for c in out.tool_calls] == ["look", "fetch", "fetch"]
    plain = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=40, regex=SHAPES[family]))
    assert plain[0].outputs[0].reasoning and "</think>" not in plain[0].outputs[0].text

    args = ["chat", "why", "--model", str(folder), "--plan", TINY_PLAN, "--regex", SHAPES[family], "--quiet"]
    code, shown, err = tfq(args, monkeypatch, capsys)
    code_hidden, hidden, _ = tfq([*args, "--thinking", "hide"], monkeypatch, capsys)
    assert code == code_hidden == 0, err
    answer = hidden.strip().splitlines()[0]
    assert shown.rstrip().endswith(answer) and len(shown) > len(hidden) and "</think>" not in shown
    code, out, err = tfq([*args[:-3], "--regex", "[a-z ]{4,24}", "--thinking", "off", "--quiet"], monkeypatch, capsys)
    assert code == 0 and out.strip(), err
    code, _, err = tfq([*args, "--thinking", "maybe"], monkeypatch, capsys)
    assert code == 2 and "--thinking 'maybe': give show, hide or off" in err


def sse_chunks(base: str, doc: dict) -> list[dict]:
    """A streamed chat's chunks, as JSON (the `[DONE]` left out)."""
    import http.client
    import json

    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(doc), headers={"Content-Type": "application/json"})
    events = conn.getresponse().read().decode().split("\n\n")
    return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]


def test_a_resumed_thinking_stream_sends_the_uninterrupted_streams_chunks(thinker):
    """A stream resumed after k tokens (resume_token_ids: a replica's death on Ray, docs/scale-out.md) sends what the
    uninterrupted one sent after its k-th token, chunk for chunk: thinking and answer deltas, calls, logprobs, ids,
    digests and the finish reason (its thinking and call state primed with the text already sent, unsent)."""
    family = thinker[0]
    spec = body(family, "why is the sea salty", temperature=0.8, seed=4, logprobs=True, top_logprobs=2)
    doc = {"model": "thinker", "stream": True, **{k: v for k, v in spec.items() if k != "extra_body"},
           **spec["extra_body"]}
    with serving(served(thinker)) as base:
        whole = sse_chunks(base, doc)
        ids = [t for c in whole for t in c["choices"][0].get("token_ids") or []]
        parts = [c["choices"][0] for c in whole]
        cuts = [k for k in (1, len(ids) // 2, len(ids) - 2) if 0 < k < len(ids)]
        for k in cuts:
            rest = [c["choices"][0] for c in sse_chunks(base, {**doc, "resume_token_ids": ids[:k]})]
            assert rest[1:] == parts[1 + k:], k  # after the opening chunk, token by token, then the last
    assert any("reasoning_content" in p["delta"] for p in parts) and len(cuts) == 3
