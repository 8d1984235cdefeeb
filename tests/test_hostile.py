"""Hostile input against a running server, beside a normal reply that keeps streaming: each case gets its
status and a one-line JSON error within a bound, and the streaming reply's time between tokens during the case
stays within a bound. Each bound is seconds on an idle machine, or as many of the streaming reply's tokens at its pace
around the case, whichever is longer: a loaded machine stretches it, a stall in the case does not.

The server runs with small limits (tfq serve's --max-body-bytes, --max-prompt-tokens, --max-stop-chars), bound
to loopback, so its Host check is on. Cases are data: (name, how to send it, the status expected).
"""
from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from served import NAME, POOL, eventually, idle, server, tiny_served
from tfq.serve.background import serving
from tfq.serve.guard import Limits, allowed_hosts

LIMITS = Limits(body_bytes=64 * 1024, prompt_tokens=300, stop_chars=64)
# Every case within CASE_BOUND_S (the stalls found took 36 s), and the streaming reply's longest gap between tokens
# during a case within GAP_BOUND_S (a stall, one request holding the engine thread or the GIL for seconds, is far
# beyond it), on an idle machine; on a loaded one, within that many of the reply's tokens at its pace then. On an idle
# 2-core machine the tokens come 0.3-1.4 ms apart; the slowest case takes 2,000 of them (0.7 s: max_tokens up to the
# window) and the longest gap is 600 (0.45 s: a new reply waits for a lane behind 16 choices of a long echoed prompt),
# both the same in tokens with six busy processes beside. CI's failure this mends: both bounds broken by 1.07x and
# 1.8x with every case 13 times as slow as alone (the suite's other workers and a tensor-parallel test's ranks).
CASE_BOUND_S, CASE_TOKENS = 10.0, 10_000
GAP_BOUND_S, GAP_TOKENS = 3.0, 2_500
# the pace: the reply's mean time a token over this many gaps, the slowest twentieth left out (a reply that waited
# behind the case before)
PACE_TOKENS = 100
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": NAME, "prompt": "hi", "max_tokens": 2}
KEY = "sesame"
JSON = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


@dataclass
class Case:
    name: str
    status: int
    body: bytes | None = None  # sent whole with http.client
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict = field(default_factory=lambda: dict(JSON))
    head_only: bytes | None = None  # raw request head sent alone on a socket (the body never comes)
    chunks: list[bytes] | None = None  # a chunked body, sent chunk by chunk
    http_level: bool = False  # refused by the HTTP parser under the app (uvicorn's own plain 400)


def js(obj) -> bytes:
    return json.dumps(obj).encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def cases() -> list[Case]:
    big = 70 * 1024  # over the 64 KiB limit
    out = [
        # -- sizes: refused before the body is read or parsed
        Case("body over the limit, declared", 413,
             head_only=b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Content-Type: application/json\r\nContent-Length: 200000000\r\n" + AUTH + b"\r\n"),
        Case("a GB body without the key is 401 before reading", 401, head_only=b"POST /v1/completions HTTP/1.1\r\n"
             b"Host: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 4000000000\r\n\r\n"),
        Case("a GB body of the wrong type is 415 before reading", 415, head_only=b"POST /v1/completions HTTP/1.1\r\n"
             b"Host: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 4000000000\r\n" + AUTH + b"\r\n"),
        Case("body over the limit, chunked", 413, chunks=[b" " * 8192] * 10),
        Case("body over the limit, sent", 413, body=b" " * big),
        Case("64 MiB of garbage", 413, head_only=b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
             b"Content-Type: application/json\r\nContent-Length: 67108864\r\n" + AUTH + b"\r\n"),
        Case("Content-Length not a number", 400, head_only=b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
             b"Content-Type: application/json\r\nContent-Length: -5\r\n" + AUTH + b"\r\n", http_level=True),
        Case("two Content-Lengths", 400, head_only=b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
             b"Content-Type: application/json\r\nContent-Length: 5\r\nContent-Length: 9\r\n" + AUTH + b"\r\n",
             http_level=True),
        Case("a body just under the limit, not JSON", 400, body=b"{" + b" " * (60 * 1024)),
        Case("a valid body padded to the limit", 200, body=js(CHAT) + b" " * (64 * 1024 - len(js(CHAT)))),
        Case("a body one byte over the limit", 413, body=js(CHAT) + b" " * (64 * 1024 - len(js(CHAT)) + 1)),
        # -- the request line and headers
        Case("no key", 401, body=js(CHAT), headers={"Content-Type": "application/json"}),
        Case("a wrong key of other bytes", 401, body=js(CHAT), headers={**JSON, "Authorization": "Bearer s\u00e9same"}),
        Case("no Content-Type", 415, body=js(CHAT), headers={"Authorization": JSON["Authorization"]}),
        Case("Content-Type text/plain", 415, body=js(CHAT), headers={**JSON, "Content-Type": "text/plain"}),
        Case("Content-Type form", 415, body=b"a=1",
             headers={**JSON, "Content-Type": "application/x-www-form-urlencoded"}),
        Case("Content-Type multipart", 415, body=b"--x--",
             headers={**JSON, "Content-Type": "multipart/form-data; boundary=x"}),
        Case("Content-Type json with charset", 200, body=js(CHAT),
             headers={**JSON, "Content-Type": "application/json; charset=utf-8"}),
        Case("a rebound DNS name", 421, body=js(CHAT), headers={**JSON, "Host": "evil.example"}),
        Case("a name ending like loopback", 421, body=js(CHAT), headers={**JSON, "Host": "127.0.0.1.evil.example:80"}),
        Case("an empty Host", 421, body=js(CHAT), headers={**JSON, "Host": ""}),
        Case("Host localhost with a port", 200, body=js(CHAT), headers={**JSON, "Host": "localhost:1234"}),
        Case("Host [::1]", 200, body=js(CHAT), headers={**JSON, "Host": "[::1]:8000"}),
        Case("GET on a POST route", 405, method="GET", body=None),
        Case("PUT with a big body", 413, method="PUT", body=b"x" * big),
        Case("unknown route", 404, path="/v1/nope", body=js(CHAT)),
        # -- lengths
        Case("a stop string over the limit", 400, body=js({**CHAT, "stop": "x" * 65})),
        Case("one of four stops over the limit", 400, body=js({**CHAT, "stop": ["a", "b", "c", "y" * 200]})),
        Case("four stops at the limit", 200, body=js({**CHAT, "stop": ["q" * 64, "w" * 64, "e" * 64, "r" * 64],
                                                      "max_tokens": 8})),
        Case("a prompt over the token limit (ids)", 400, path="/v1/completions",
             body=js({**TEXT, "prompt": [5] * 301})),
        Case("a prompt at the token limit (ids)", 200, path="/v1/completions", body=js({**TEXT, "prompt": [5] * 300})),
        Case("one of two prompts over the limit", 400, path="/v1/completions",
             body=js({**TEXT, "prompt": [[5] * 10, [6] * 400]})),
        Case("a text prompt over the token limit", 400, path="/v1/completions",
             body=js({**TEXT, "prompt": "a b " * 400})),
        Case("60 KB of prompt is refused by its length, untokenized", 400, path="/v1/completions",
             body=js({**TEXT, "prompt": "x" * 60_000})),
        Case("a chat over the token limit", 400,
             body=js({**CHAT, "messages": [{"role": "user", "content": "a b " * 400}]})),
        Case("a thousand tiny messages", 400, body=js({**CHAT, "messages": [{"role": "user", "content": "a"}] * 1000})),
        Case("a prompt as long as the window", 400, path="/v1/completions", body=js({**TEXT, "prompt": [5] * 512})),
        # -- depths
        Case("prompt nested 100,000 deep", 400, path="/v1/completions",
             body=b'{"model": "tiny", "max_tokens": 2, "prompt": ' + nested(30_000).encode() + b"}"),
        Case("content parts nested deep", 400, body=b'{"model": "tiny", "messages": [{"role": "user", "content": ['
             + ("{\"a\":" * 8_000 + "1" + "}" * 8_000).encode() + b"]}]}"),
        Case("logit_bias nested deep", 400, body=b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"logit_bias": ' + ("{\"a\":" * 5_000 + "1" + "}" * 5_000).encode() + b"}"),
        Case("a top-level array nested deep", 400, body=nested(30_000).encode()),
        Case("a content part's extra field 500 deep is ignored", 200,
             body=js({**CHAT, "messages": [{"role": "user", "content": [
                 {"type": "text", "text": "x", "extra": json.loads(nested(500))}]}]})),
        # -- numbers at their limits
        Case("max_tokens 10**100 ends at the window", 200, path="/v1/completions",
             body=js({**TEXT, "max_tokens": 10 ** 100})),
        Case("seed 2**64", 400, body=js({**CHAT, "seed": 2 ** 64})),
        Case("seed -2**63 - 1", 400, body=js({**CHAT, "seed": -(2 ** 63) - 1})),
        Case("seed 2**64 - 1", 200, body=js({**CHAT, "seed": 2 ** 64 - 1})),
        Case("temperature 1e-40", 200, body=js({**CHAT, "temperature": 1e-40})),
        Case("temperature 2.0000001", 400, body=js({**CHAT, "temperature": 2.0000001})),
        Case("temperature 1e400 (inf)", 400, body=b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"temperature": 1e400}'),
        Case("temperature NaN", 400, body=b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"temperature": NaN}'),
        Case("top_p -Infinity", 400, body=b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
             b'"top_p": -Infinity}'),
        Case("top_p 5e-324", 200, body=js({**CHAT, "top_p": 5e-324, "temperature": 1.0})),
        Case("temperature 1e-300 (0 in float32) draws", 200, body=js({**CHAT, "temperature": 1e-300})),
        Case("repetition_penalty 1e-45 (a row of +inf)", 400, body=js({**CHAT, "repetition_penalty": 1e-45,
                                                                       "temperature": 1.0})),
        Case("repetition_penalty 0.1 samples", 200, body=js({**CHAT, "repetition_penalty": 0.1, "temperature": 1.0})),
        Case("logit_bias keyed by a superscript digit", 400, body=js({**CHAT, "logit_bias": {"\u00b2": 1}})),
        Case("logit_bias keyed by 5,000 digits", 400, body=js({**CHAT, "logit_bias": {"7" * 5000: 1}})),
        Case("logit_bias naming a token twice", 400, body=js({**CHAT, "logit_bias": {"7": 1, "007": -1}})),
        Case("logit_bias of 301 tokens", 400, body=js({**CHAT, "logit_bias": {str(t): 1 for t in range(301)}})),
        Case("logit_bias of 300 tokens", 200, body=js({**CHAT, "logit_bias": {str(t): 1 for t in range(300)}})),
        Case("n 17", 400, body=js({**CHAT, "n": 17})),
        Case("top_logprobs 21", 400, body=js({**CHAT, "logprobs": True, "top_logprobs": 21})),
        Case("max_tokens 1e3 (a float)", 400, body=js({**CHAT, "max_tokens": 1e3})),
        Case("max_tokens true", 400, body=js({**CHAT, "max_tokens": True})),
        # -- unicode
        Case("a lone high surrogate in content", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "a\\ud800b"}]}'),
        Case("a lone low surrogate in content", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "\\udc00"}]}'),
        Case("a lone surrogate in a content part", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": [{"type": "text", "text": "\\ud83d"}]}]}'),
        Case("a lone surrogate in a prompt", 400, path="/v1/completions",
             body=b'{"model": "tiny", "prompt": "x\\ud800", "max_tokens": 2}'),
        Case("a lone surrogate in one of several prompts", 400, path="/v1/completions",
             body=b'{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
        Case("a lone surrogate in a stop string", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "x"}], "stop": ["\\ud800"]}'),
        Case("a lone surrogate in user", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "x"}], "user": "\\ud800"}'),
        Case("a lone surrogate as a key", 400, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "x"}], "\\ud800": 1}'),
        Case("a surrogate pair is a character", 200, body=b'{"model": "tiny", "messages": [{"role": "user", '
             b'"content": "\\ud83d\\ude00"}], "max_tokens": 2}'),
        Case("NUL in content", 200, body=js({**CHAT, "messages": [{"role": "user", "content": "a\u0000b"}]})),
        Case("bidi overrides and combining marks", 200, body=js({**CHAT, "messages": [
            {"role": "user", "content": "\u202e\u0301\u0301abc\u2066"}]})),
        Case("bytes that are not UTF-8", 400, body=b'{"model": "tiny", "prompt": "\xc0\xaf\xff", "max_tokens": 2}',
             path="/v1/completions"),
        Case("a UTF-8 byte order mark is read past", 200, body=b"\xef\xbb\xbf" + js(CHAT)),
        Case("a stop string of emoji", 200, body=js({**CHAT, "stop": ["\U0001F600" * 16]})),
        # -- shapes
        Case("duplicate keys: the last wins", 400, body=b'{"model": "tiny", "model": "gpt-4", "messages": '
             b'[{"role": "user", "content": "x"}]}'),
        Case("a million-element prompt list over the body limit", 413, path="/v1/completions",
             body=js({**TEXT, "prompt": [1] * 30_000})),
        Case("messages a huge list of nulls", 400, body=js({**CHAT, "messages": [None] * 10_000})),
        Case("echo with logprobs n 16 on a long prompt", 200, path="/v1/completions",
             body=js({**TEXT, "prompt": [7] * 290, "echo": True, "logprobs": 5, "n": 16, "max_tokens": 1})),
    ]
    return out


# -- sending ------------------------------------------------------------------------------------------------
def send(base: str, case: Case) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    if case.head_only is not None or case.chunks is not None:
        return _socket(host, int(port), case)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    headers = dict(case.headers)
    if "Host" in headers:
        conn.putrequest(case.method, case.path, skip_host=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(case.body or b"")))
        conn.endheaders(case.body)
    else:
        conn.request(case.method, case.path, body=case.body, headers=headers)
    r = conn.getresponse()
    return r.status, r.read()


def _socket(host: str, port: int, case: Case) -> tuple[int, bytes]:
    with socket.create_connection((host, port), timeout=300) as s:
        if case.head_only is not None:
            s.sendall(case.head_only)
        else:
            s.sendall(f"POST {case.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Transfer-Encoding: chunked\r\n".encode() + AUTH + b"\r\n")
            try:
                for chunk in case.chunks:
                    s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                s.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before the end
                pass
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, r.read()


# -- the reply that keeps streaming beside the cases --------------------------------------------------------
class Beside:
    """Streams greedy replies one after another on its own thread, noting when each is asked for and when each of
    its tokens arrives: a stall while one reply has ended and the next waits for its first token is a gap too."""

    def __init__(self, base: str):
        self.base = base
        self.arrivals: list[tuple[int, float]] = []  # (reply number, time)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Beside":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join(120)

    def _run(self) -> None:
        host, port = self.base.removeprefix("http://").split(":")
        reply = 0
        while not self.stop.is_set():
            reply += 1
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            self.arrivals.append((reply, time.perf_counter()))
            conn.request("POST", "/v1/completions", body=js({"model": NAME, "prompt": "def fibonacci(n):",
                                                              "max_tokens": 200, "temperature": 0, "stream": True}),
                         headers=JSON)
            r = conn.getresponse()
            for line in r:
                if line.startswith(b"data: {") and b'"text": ""' not in line:
                    self.arrivals.append((reply, time.perf_counter()))
                if self.stop.is_set():
                    break
            conn.close()

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between one reply's consecutive tokens that overlap [start, end]."""
        marks = list(self.arrivals)
        return [b - a for (ra, a), (rb, b) in zip(marks, marks[1:]) if ra == rb and b >= start and a <= end]

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        have = len(self.arrivals)
        eventually(lambda: len(self.arrivals) >= have + n, timeout_s)

    def pace(self, start: float = 0.0, end: float = math.inf, first: bool = False) -> float:
        """The mean time a token within [start, end], over the last PACE_TOKENS gaps there (the first, if `first`),
        the slowest twentieth left out."""
        marks = list(self.arrivals)
        inside = [b - a for (ra, a), (rb, b) in zip(marks, marks[1:]) if ra == rb and a >= start and b <= end]
        kept = sorted(inside[:PACE_TOKENS] if first else inside[-PACE_TOKENS:])
        kept = kept[:len(kept) - len(kept) // 20]
        return sum(kept) / len(kept)

    def pace_around(self, start: float, end: float) -> float:
        """The slower of the pace before start and after end (the case's own gaps left out, so that a stall in it
        does not stretch its own bounds)."""
        self.wait_tokens(PACE_TOKENS + 1)
        return max(self.pace(end=start), self.pace(start=end, first=True))


def bound(seconds: float, tokens: int, pace: float) -> float:
    return max(seconds, tokens * pace)


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


@pytest.fixture(scope="module")
def running(tiny):
    served = server(tiny, api_keys=(KEY,), served={"limits": LIMITS, "hosts": allowed_hosts("127.0.0.1")})
    with serving(served) as base, Beside(base) as beside:
        beside.wait_tokens(PACE_TOKENS + 1)
        yield base, beside
    assert not beside.thread.is_alive()


CASES = cases()


def test_there_are_at_least_fifty_cases_and_most_are_refusals():
    assert len(CASES) >= 50 and len({c.name for c in CASES}) == len(CASES)
    assert sum(c.status >= 400 for c in CASES) >= 50


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_request_gets_its_answer_and_the_reply_beside_it_streams_on(running, case):
    base, beside = running
    start = time.perf_counter()
    status, body = send(base, case)
    took = time.perf_counter() - start
    pace = beside.pace_around(start, start + took)  # and a gap that began during the case has ended
    gaps = beside.gaps(start, start + took)
    assert status == case.status, body[:300]
    if status >= 400 and not case.http_level:
        message = json.loads(body)["error"]["message"]
        assert message and "\n" not in message and "Traceback" not in message
    assert took < bound(CASE_BOUND_S, CASE_TOKENS, pace), (took, pace)
    assert max(gaps, default=0.0) <= bound(GAP_BOUND_S, GAP_TOKENS, pace), (max(gaps), pace)


def test_after_the_cases_every_page_is_back_and_the_server_is_healthy(running):
    base, beside = running
    status, body = send(base, Case("health", 200, method="GET", path="/health", body=None))
    assert status == 200 and json.loads(body)["status"] == "ok"
    beside.stop.set()
    beside.thread.join(120)
    m = idle(base, key=KEY)
    assert m["tfq_pages_free"] == POOL and m["tfq_lanes_busy"] == 0 and m["tfq_streams"] == 0


def test_the_gap_bound_catches_a_stall(tiny):
    """The control: a request that stalls the engine thread (its stop handling held on purpose until the reply
    beside it has had no token for HOLD times the bound and a second more) shows in that reply as a gap past the
    bound, stretched by the pace around it as the cases' is."""
    import tfq.engine.stream as stream

    HOLD = 2  # the bound is known after the stall, from the pace after it too: the stall outlasts it unless the
    # machine runs twice as slow after the stall as before it
    served = server(tiny, api_keys=(KEY,), served={"limits": LIMITS})
    real = stream.held_back
    stalled, released = threading.Event(), threading.Event()

    def slow(text: str, stops: tuple[str, ...]) -> int:
        if "zzz" in stops:
            stalled.set()
            released.wait(600)  # the stall itself, on the engine thread
        return real(text, stops)

    with serving(served) as base, Beside(base) as beside:
        beside.wait_tokens(PACE_TOKENS + 1)
        hold = HOLD * bound(GAP_BOUND_S, GAP_TOKENS, beside.pace(end=time.perf_counter())) + 1.0
        quiet = lambda: time.perf_counter() - beside.arrivals[-1][1] > hold  # noqa: E731

        def release() -> None:  # once the stall has begun and the reply beside it has waited out the hold
            stalled.wait(600)
            eventually(quiet, 600)
            released.set()

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        stream.held_back = slow
        try:
            start = time.perf_counter()
            status, _ = send(base, Case("slow", 200, body=js({**CHAT, "stop": ["zzz"], "max_tokens": 2})))
            took = time.perf_counter() - start
            pace = beside.pace_around(start, start + took)
        finally:
            released.set()
            stream.held_back = real
        assert status == 200
        assert max(beside.gaps(start, start + took)) > bound(GAP_BOUND_S, GAP_TOKENS, pace), pace



def test_a_whole_response_is_built_off_the_event_loop(tiny, monkeypatch):
    """A whole response's body is built off the event loop: held in its building until the reply beside it has had
    20 more tokens, it lets that reply stream on. The control builds it on the loop, as before, where the building
    sees a running loop (and does not wait: nothing would stream)."""
    import asyncio

    from fastapi.responses import JSONResponse

    import tfq.serve.app as app

    real, seen = app.text_choice, []

    def held(*args, **kw):
        try:
            asyncio.get_running_loop()
            seen.append("on the loop")
        except RuntimeError:
            have = len(beside.arrivals)
            seen.append("streamed" if eventually(lambda: len(beside.arrivals) >= have + 20, 60) else "stalled")
        return real(*args, **kw)

    async def on_the_loop(build):
        return JSONResponse(build())

    monkeypatch.setattr(app, "text_choice", held)
    for control in (False, True):
        if control:
            monkeypatch.setattr(app, "whole", on_the_loop)
        with serving(server(tiny, api_keys=(KEY,))) as base, Beside(base) as beside:
            beside.wait_tokens(3)
            status, _ = send(base, Case("whole", 200, path="/v1/completions", body=js(TEXT)))
        assert status == 200
    assert seen == ["streamed", "on the loop"]
