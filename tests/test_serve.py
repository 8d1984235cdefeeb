"""`tfq serve` on a tiny model: exact under load with the real `openai` client, a control that comes out RED,
and faults (hostile bodies, a burst over the queue, clients that go away, SIGTERM) that leave it serving with
every page back in the pool."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from serve_load import calls, differences, fire
from served import NAME, POOL, TINY_PLAN, idle, raw, replies_alone, server, tiny_served, until
from tfq.engine.core import Controls, Engine
from tfq.engine.runner import paged_partial
from tfq.serve.background import ServeOptions, build_served, serving


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


@pytest.fixture(scope="module")
def load():
    return calls(seed=0)


@pytest.fixture(scope="module")
def alone(tiny, load):
    """Each call sent alone to a fresh server."""
    return replies_alone(lambda: server(tiny), NAME, load)


def test_the_load_is_what_the_issue_asks(tiny, load):
    plan, layout, loaded = tiny
    assert len(load) == 32
    assert {c.chat for c in load} == {True, False} and any(c.stream for c in load)
    assert any(c.body["n"] == 2 for c in load) and any(c.body["temperature"] > 0 for c in load)
    assert len({c.body["max_tokens"] for c in load}) > 10
    longest = max(len(loaded.tokenizer.encode(c.body.get("prompt", ""))) for c in load)
    assert 256 < longest < layout.window - 40  # past one split of `partial`, within the window


def test_under_load_every_reply_equals_its_run_alone(tiny, load, alone):
    with serving(server(tiny)) as base:
        under = asyncio.run(fire(base, NAME, load))
        after = idle(base)
    assert differences(under, alone, load) == []
    assert after["tfq_preemptions_total"] > 0, "the pool never ran dry: preemption went untested"
    assert after["tfq_pages_free"] == POOL and after["tfq_streams"] == 0 and after["tfq_lanes_busy"] == 0
    assert after['tfq_requests_total{outcome="finished"}'] == len(load)
    assert all(r[0]["logprobs"] and r[0]["digests"] for r in under)


def test_under_load_with_the_prefix_cache(tiny):
    """The same kind of load with the prefix cache on: long prompts share their first pages, and every reply
    still equals its run alone on a fresh server without the cache, the prompt scores of echoed completions too
    (their n = 2 choices and warm prompts compute every prompt row)."""
    plan, layout, loaded = tiny
    load = calls(seed=5, shared=True, echo=True)
    assert any(c.body.get("echo") and c.body["n"] == 2 for c in load)
    on = plan.set("kv.prefix_cache", "on", "test")
    alone = replies_alone(lambda: server(tiny), NAME, load)
    served = build_served(on, layout, loaded, NAME)
    with serving(served) as base:
        under = asyncio.run(fire(base, NAME, load))
        after = idle(base)
    assert differences(under, alone, load) == []
    assert after["tfq_prefix_cache_reused_rows_total"] > 0 and after["tfq_pages_free"] == POOL
    echoed = [r for r, c in zip(under, load) if c.body.get("echo")]
    assert echoed and all(len(ch["logprobs"]) > len(ch["ids"]) for r in echoed for ch in r)  # prompts' scores too


def test_tenants_share_no_prefix_cache_pages_and_metrics_need_a_key(tiny):
    """With several API keys each key is a tenant: a prompt another key sent is not found in the prefix cache (its
    reused rows stay 0), one the same key sent is, and the reply is the same bits either way. /metrics, which counts
    those rows, needs a key. The control: two clients of one key share pages (the rows move)."""
    plan, layout, loaded = tiny
    on = plan.set("kv.prefix_cache", "on", "test").set("kv.paged", "all", "test")  # every lane publishes its pages
    prompt = "def fibonacci(n):\n" * 40  # several full pages

    def ask(base: str, key: str) -> tuple[list, float]:
        status, _, body = raw(base, "POST", "/v1/completions", json.dumps(
            {"model": NAME, "prompt": prompt, "max_tokens": 4, "return_digests": True}).encode(),
            {"Authorization": f"Bearer {key}"})
        assert status == 200, body
        reused = idle(base, key=key)["tfq_prefix_cache_reused_rows_total"]
        return json.loads(body)["choices"][0]["digests"], reused

    with serving(build_served(on, layout, loaded, NAME, ServeOptions(api_keys=("alpha", "beta")))) as base:
        assert raw(base, "GET", "/metrics", None)[0] == 401
        assert raw(base, "GET", "/health", None)[0] == 200  # a probe needs no key
        first, _ = ask(base, "alpha")
        other, after_other = ask(base, "beta")
        own, after_own = ask(base, "alpha")
    assert first == other == own
    assert after_other == 0 < after_own
    with serving(build_served(on, layout, loaded, NAME, ServeOptions(api_keys=("alpha",)))) as base:  # the control
        ask(base, "alpha")
        assert ask(base, "alpha")[1] > 0
    with serving(build_served(on, layout, loaded, NAME)) as base:  # no key: metrics open, as before
        assert raw(base, "GET", "/metrics", None)[0] == 200


def test_control_paged_partial_under_load_comes_out_red(tiny, load, alone):
    """The field report's split: forwards holding a paged stream run `partial`. The two long prompts start
    together, so one of them runs on pages, past one 256-key split: its logits change."""
    with serving(server(tiny, controls=Controls(arithmetic=paged_partial))) as base:
        under = asyncio.run(fire(base, NAME, load))
    assert differences(under, alone, load) != []


def test_choice_zero_of_n_is_the_request_with_n_1(tiny):
    from openai import OpenAI

    with serving(server(tiny)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        kw = dict(model=NAME, prompt="def fibonacci", max_tokens=12, temperature=1.0, seed=7,
                  extra_body={"return_token_ids": True})
        two = client.completions.create(n=2, **kw).model_dump()["choices"]
        one = client.completions.create(n=1, **kw).model_dump()["choices"]
    assert two[0]["token_ids"] == one[0]["token_ids"]
    assert two[0]["token_ids"] != two[1]["token_ids"]  # choice 1 draws with another seed


def test_echo_returns_the_prompts_log_probabilities(tiny):
    """Completions with echo and logprobs score every prompt token after the first, as evaluation harnesses
    read them; the scores do not depend on how the prompt was chunked (tiny plan: 64-row chunks)."""
    from openai import OpenAI

    prompt = "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n" * 6
    with serving(server(tiny)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=0,
                                      temperature=0).model_dump()
    lp = r["choices"][0]["logprobs"]
    prompt_len = r["usage"]["prompt_tokens"]
    assert prompt_len > 64 and len(lp["tokens"]) == prompt_len + 1
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    assert r["choices"][0]["text"].startswith(prompt)
    plan, layout, loaded = tiny
    from tfq.engine.stream import Request

    whole = Engine.from_plan(plan.set("prefill_chunk", 512, "test"), layout, loaded)
    ids = loaded.tokenizer.encode(prompt)
    res = whole.generate([Request(tuple(ids), max_tokens=1, prompt_logprobs=0)])[0]
    assert [s.logprob for s in res.prompt_logprobs[1:]] == lp["token_logprobs"][1:prompt_len]


# -- faults ----------------------------------------------------------------------------------------------
def hostile_requests() -> list[tuple[str, bytes, dict, int]]:
    """(path, body, headers, expected status): 200 of them, malformed or hostile."""
    ok_chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok_text = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    auth = {"Authorization": "Bearer sesame"}
    cases: list[tuple[str, bytes, dict, int]] = []

    def body(path, d, status, headers=auth):
        cases.append((path, json.dumps(d).encode() if not isinstance(d, bytes) else d, headers, status))

    for path, ok in (("/v1/chat/completions", ok_chat), ("/v1/completions", ok_text)):
        for bad in (b"{", b"", b"null", b"[1, 2", b"\xff\xfe\x00", b'{"model": }', b"42", b'"text"'):
            body(path, bad, 400)
        for key, value in (("max_tokens", -5), ("max_tokens", 0), ("max_tokens", "ten"), ("max_tokens", 2.5),
                           ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1),
                           ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 1000),
                           ("n", "two"), ("seed", "x"), ("seed", 2 ** 70), ("stop", 5), ("stop", ["a"] * 9),
                           ("stream", "yes"), ("presence_penalty", 2.5), ("logit_bias", {"5": 101}),
                           ("logit_bias", {"five": 1}), ("repetition_penalty", 0), ("response_format", {"type": "xml"}),
                           ("response_format", {"type": "json_schema"}), ("structured_outputs", {"regex": "("}),
                           ("frobnicate", True), ("return_token_ids", "maybe"), ("stream_options", {"x": 1}),
                           ("model", 7), ("model", None)):
            body(path, {**ok, key: value}, 400)
        body(path, {**ok, "model": "gpt-4"}, 400)
        body(path, {k: v for k, v in ok.items() if k != "model"}, 400)
        body(path, ok, 401, headers={})
        body(path, ok, 401, headers={"Authorization": "Bearer wrong"})
        body(path, ok, 401, headers={"Authorization": "sesame"})
    huge = "lorem ipsum " * 90_000  # about 1 MB
    for bad in ({"messages": []}, {"messages": "hi"}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                {"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 50}, {"max_completion_tokens": -1},
                {"messages": [{"role": "user", "content": huge}]}):
        body("/v1/chat/completions", {**ok_chat, **bad}, 400)
    for bad in ({"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1, 5]}, {"prompt": [10 ** 9]},
                {"prompt": {"a": 1}}, {"logprobs": 21}, {"logprobs": -1}, {"suffix": "x"}, {"best_of": 3},
                {"prompt": huge}, {"prompt": [1] * 600}, {"echo": "no"}):
        body("/v1/completions", {**ok_text, **bad}, 400)
    distinct = len(cases)
    assert distinct > 90
    while len(cases) < 200:  # the rest: the same cases again, in another order
        cases.append(cases[(len(cases) * 7) % distinct])
    return cases


def test_hostile_requests_get_their_status_and_the_server_keeps_serving(tiny):
    cases = hostile_requests()
    with serving(server(tiny, api_keys=("sesame",))) as base:
        for path, body, headers, want in cases:
            status, _, reply = raw(base, "POST", path, body, headers)
            assert status == want, (path, body[:80], reply[:200])
            error = json.loads(reply)["error"]
            assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
        status, _, reply = raw(base, "GET", "/v1/nothing", None, {"Authorization": "Bearer sesame"})
        assert status == 404 and json.loads(reply)["error"]["message"]
        assert raw(base, "GET", "/v1/nothing", None)[0] == 401  # without the key, no route is told apart
        status, _, reply = raw(base, "POST", "/v1/completions",
                               json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 3}).encode(),
                               {"Authorization": "Bearer sesame"})
        assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 3
        m = idle(base, key="sesame")
    assert m["tfq_pages_free"] == POOL and m["tfq_streams"] == 0
    assert m['tfq_requests_total{outcome="invalid"}'] + m['tfq_requests_total{outcome="unauthorized"}'] >= 190


def test_a_burst_over_the_queue_gets_429_with_retry_after(tiny):
    from openai import AsyncOpenAI, RateLimitError

    async def burst(base):
        async with AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            async def one(i):
                try:
                    r = await client.completions.create(model=NAME, prompt=f"request {i}", max_tokens=24,
                                                        temperature=0)
                    return r.usage.completion_tokens
                except RateLimitError as e:
                    return ("busy", e.response.headers.get("retry-after"), e.body)
            return await asyncio.gather(*(one(i) for i in range(20)))

    with serving(server(tiny, queue=2)) as base:  # 4 lanes + 2 waiting
        got = asyncio.run(burst(base))
        m = idle(base)
        status, _, reply = raw(base, "POST", "/v1/completions", json.dumps(
            {"model": NAME, "prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 2}).encode())
        assert status == 400 and json.loads(reply)["error"]["param"] == "n"  # 8 streams can never fit in 6
    refused = [g for g in got if isinstance(g, tuple)]
    assert refused and len(refused) < 20
    assert all(g[1] == "1" and "busy" in g[2]["message"] for g in refused)
    assert all(g == 24 for g in got if not isinstance(g, tuple))
    assert m['tfq_requests_total{outcome="busy"}'] == len(refused)
    assert m["tfq_pages_free"] == POOL and m["tfq_streams"] == 0


def held_after_a_token(served):
    """(drawn, release): the engine stops after the first step that draws a token, until the test releases it,
    so a client can leave while its request is surely running."""
    engine, drawn, release = served.loop.engine, threading.Event(), threading.Event()
    real = engine.step

    def step():
        out = real()
        if any(o.token >= 0 for o in out):
            drawn.set()
            release.wait(120)
        return out

    engine.step = step
    return drawn, release


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_streams(tiny, stream):
    served = server(tiny)
    drawn, release = held_after_a_token(served)
    with serving(served) as base:
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
        body = {"model": NAME, "prompt": "x " * 40, "max_tokens": 400, "temperature": 0, "stream": stream}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        assert drawn.wait(60)
        conn.close()  # gone mid-reply
        until(base, lambda m: m['tfq_requests_total{outcome="aborted"}'] == 1)  # the server saw it go
        release.set()
        m = idle(base)
        assert m["tfq_streams"] == 0 and m["tfq_pages_free"] == POOL and m["tfq_lanes_busy"] == 0
        assert m['tfq_requests_total{outcome="aborted"}'] == 1
        assert m["tfq_generation_tokens_total"] < 400  # it did not run to the end
        status, _, reply = raw(base, "POST", "/v1/completions",
                               json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2}).encode())
        assert status == 200


def test_sigterm_finishes_what_is_in_flight_and_exits_0(tiny_dirs):
    proc = subprocess.Popen([sys.executable, "-m", "tfq", "serve", "--model", str(tiny_dirs["qwen2"]), "--plan",
                             TINY_PLAN, "--port", "0", "--quiet", "--name", NAME], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server ended before serving"
        base = re.search(r"(http://[0-9.:]+)/v1", line).group(1)  # listening already: connections wait in its backlog
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 60,
                                                                 "stream": True, "temperature": 0}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")  # the reply in flight was finished
        assert proc.wait(60) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], "not a TCP port"),
    (["--queue", "-1"], "--queue"),
    (["--host", "no.such.host.invalid"], "--host"),
    (["--log-level", "loud"], "--log-level loud: give debug, info, warning or error"),
    (["--max-body-bytes", "0"], "--max-body-bytes 0: give a positive number"),
    (["--max-prompt-tokens", "-1"], "--max-prompt-tokens -1"),
    (["--replicas", "-1"], "give 1 or more replicas"),
    (["--ray", " "], "give 1 or more replicas and an address"),
    (["--replicas", "2", "--port", "0"], "Ray Serve's proxy needs a port from 1 to 65535"),
])
def test_serve_bad_options_are_one_line_exit_2(tiny_dirs, args, words):
    r = subprocess.run([sys.executable, "-m", "tfq", "serve", "--model", str(tiny_dirs["qwen2"]), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
