"""Faults inside a running server: a request whose own processing raises fails alone (500 naming the fault) while
the others go on; a failed forward fails its own streams; forwards failing in a row, a loop thread that dies and
a step that never ends make /health say 503 and the server exit (non-zero for `tfq serve`), never a hang. After
each: every page back, no lane held, /health truthful.

Faults are put in by the tests, at seams of the engine (its sampler, its stop search, a stream's decoder, the
forward's logits), not by flags of the product."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import tfq.engine.core
import tfq.engine.stream
from served import NAME, POOL, TINY_PLAN, eventually, idle, raw, server, tiny_served
from test_draft import RandomDrafter
from tfq.decode.grammar import OwnCompile
from tfq.engine.core import Controls
from tfq.errors import Unservable
from tfq.serve import background
from tfq.serve.background import serving

POISON = 666  # the seed of the request a fault is put in


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


def completion(base: str, seed: int, max_tokens: int = 24) -> tuple[int, dict]:
    status, _, body = raw(base, "POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0.7, "seed": seed,
         "return_digests": True}).encode())
    return status, json.loads(body)


def health(base: str) -> tuple[int, dict]:
    status, _, body = raw(base, "GET", "/health", None)
    return status, json.loads(body)


def settled(base: str) -> dict:
    """After a fault the server keeps serving: nothing held, every page back, /health ok."""
    m = idle(base)
    assert m["tfq_pages_free"] == POOL and m["tfq_lanes_busy"] == 0 and m["tfq_streams"] == 0
    assert health(base) == (200, {"status": "ok", "engine": "idle", "streams": 0})
    return m


# -- a request's own fault -----------------------------------------------------------------------------------
class Exploding:
    """A stream decoder that fails on its first token."""

    def feed(self, token: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a decoder fault put in by the test")

    def flush(self) -> str:
        return ""


def sampler(monkeypatch, engine):
    real = tfq.engine.core.sample

    def sample(logits, temperature, top_p, seed, position):
        if seed == POISON:
            raise RuntimeError("a sampler fault put in by the test")
        return real(logits, temperature, top_p, seed, position)

    monkeypatch.setattr(tfq.engine.core, "sample", sample)
    return "RuntimeError: a sampler fault"


def stops(monkeypatch, engine):
    real = tfq.engine.stream.first_stop

    def first_stop(text, stops, start=0):
        if "never" in stops:
            raise IndexError("a stop-search fault put in by the test")
        return real(text, stops, start)

    monkeypatch.setattr(tfq.engine.stream, "first_stop", first_stop)
    return "IndexError: a stop-search fault"


def decoder(monkeypatch, engine):
    real = engine.add

    def add(request, grammar=None):
        id_ = real(request, grammar)
        if request.seed == POISON:
            engine.streams[id_].decoder = Exploding()
        return id_

    monkeypatch.setattr(engine, "add", add)
    return "UnicodeDecodeError"


def logits_row(monkeypatch, engine):
    """The poisoned stream's logits rows come out NaN, and what the model's one object says of them with them."""
    real, facts, hit = engine.runner.run, engine.runner.drawn, set()

    def run(feeds):
        rows = real(feeds)
        poisoned = {id(st.placement) for st in engine.streams.values() if st.request.seed == POISON}
        hit.clear()
        hit.update(i for i, f in enumerate(feeds) if id(f.placement) in poisoned)
        return [r.clone().fill_(float("nan")) if i in hit else r for i, r in enumerate(rows)]

    monkeypatch.setattr(engine.runner, "run", run)
    monkeypatch.setattr(engine.runner, "drawn", lambda i: facts(i) and ((False, -1) if i in hit else facts(i)))
    return "FloatingPointError: the logits row at position"


def poisoned_beside(base: str, poisoned: dict) -> tuple[int, dict, list]:
    """The poisoned completion sent with seeds 1 and 2 beside it: its status and error, and their answers."""
    with ThreadPoolExecutor(3) as pool:
        bad = pool.submit(raw, base, "POST", "/v1/completions", json.dumps(poisoned).encode())
        good = [pool.submit(completion, base, seed) for seed in (1, 2)]
        status, _, body = bad.result()
        return status, json.loads(body)["error"], [g.result() for g in good]


@pytest.mark.parametrize("fault", [sampler, stops, decoder, logits_row])
def test_a_requests_own_fault_fails_it_alone(tiny, monkeypatch, fault):
    """The poisoned request gets a 500 naming its fault; the ones beside it equal their runs alone."""
    with serving(server(tiny)) as base:
        alone = [completion(base, seed) for seed in (1, 2)]
    served = server(tiny)
    words = fault(monkeypatch, served.loop.engine)
    with serving(served) as base:
        poisoned = {"model": NAME, "prompt": "def fibonacci(n):", "max_tokens": 24, "seed": POISON}
        if fault is stops:
            poisoned["stop"] = ["never"]
        status, error, beside = poisoned_beside(base, poisoned)
        assert status == 500 and words in error["message"] and error["type"] == "server_error"
        assert "\n" not in error["message"]
        assert [(s, b["choices"][0]["digests"]) for s, b in beside] == [(s, b["choices"][0]["digests"])
                                                                         for s, b in alone]
        m = settled(base)
        assert m['tfq_requests_total{outcome="failed"}'] == 1 and m['tfq_requests_total{outcome="finished"}'] == 2


class Panic(BaseException):
    """Stands for pyo3's PanicException: a Rust panic (in llguidance, in tokenizers) reaches Python as a
    BaseException, which `except Exception` lets through."""


class PanickingGuessChecks:
    """A compile whose matchers panic checking a drafter's guesses once the reply has `after` tokens: a fault
    inside llguidance, mid-reply, on the path only drafting takes."""

    def __init__(self, after: int):
        self.after, self.own = after, OwnCompile()

    def __call__(self, llg, text: str):
        return _Panicking(self.own(llg, text), self.after)


class _Panicking:
    def __init__(self, matcher, after: int, taken: int = 0):
        self.m, self.after, self.taken = matcher, after, taken

    def deep_copy(self):
        return _Panicking(self.m.deep_copy(), self.after)

    def consume_token(self, token: int) -> bool:
        self.taken += 1
        return self.m.consume_token(token)

    def validate_tokens(self, tokens: list[int]) -> int:
        if self.taken >= self.after:
            raise Panic("a panic in the grammar library put in by the test")
        return self.m.validate_tokens(tokens)

    def __getattr__(self, name: str):
        return getattr(self.m, name)


def test_a_grammar_that_panics_mid_reply_under_drafting_fails_its_stream_alone(tiny):
    """The constrained stream's grammar panics while its guesses are checked (before the step's forward): that
    request gets a 500 naming it; the requests beside it equal their runs alone; /health stays ok."""
    vocab = tiny[2].config.vocab_size
    with serving(server(tiny, drafter=RandomDrafter(3, vocab, 5))) as base:
        alone = [completion(base, seed) for seed in (1, 2)]
    served = server(tiny, drafter=RandomDrafter(3, vocab, 5), controls=Controls(compile=PanickingGuessChecks(3)))
    with serving(served) as base:
        poisoned = {"model": NAME, "prompt": "def fibonacci(n):", "max_tokens": 24, "seed": POISON,
                    "structured_outputs": {"regex": "[a-z ]{8,40}"}}
        status, error, beside = poisoned_beside(base, poisoned)
        assert status == 500 and "checking its drafted tokens: Panic" in error["message"]
        assert [b["choices"][0]["digests"] for _, b in beside] == [b["choices"][0]["digests"] for _, b in alone]
        settled(base)
        assert served.loop.dead is None


# -- the forward's faults ------------------------------------------------------------------------------------
def failing_forwards(engine, times: int) -> threading.Event:
    """The next `times` forwards raise (then they run again); the event is set at the first."""
    real, left, hit = engine.runner.run, [times], threading.Event()

    def run(feeds):
        if left[0] > 0:
            left[0] -= 1
            hit.set()
            raise RuntimeError("a forward fault put in by the test")
        return real(feeds)

    engine.runner.run = run
    return hit


def test_one_failed_forward_fails_its_streams_and_the_server_goes_on(tiny):
    served = server(tiny)
    failing_forwards(served.loop.engine, 1)
    with serving(served) as base:
        status, body = completion(base, 1)
        assert status == 500 and "the forward failed: RuntimeError: a forward fault" in body["error"]["message"]
        settled(base)
        status, body = completion(base, 1)
        assert status == 200 and len(body["choices"][0]["digests"]) == 24


def gone(base: str) -> bool:
    """Whether nothing answers at `base` any more (the server stopped)."""
    try:
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=5)
        conn.request("GET", "/health")
        conn.getresponse().read()
        return False
    except OSError:
        return True


@pytest.fixture
def exit_held(monkeypatch):
    """The server's own exit when its engine dies, held until the test sets this event: the exit comes at once, so
    on a loaded machine it could come before dead_server has seen the 503s a dead engine's server answers."""
    held = threading.Event()
    real = background.uvicorn_server

    def uvicorn_server(served, graceful_s: float):
        server = real(served, graceful_s)
        tell = served.loop.on_dead
        served.loop.on_dead = lambda reason: threading.Thread(target=lambda: (held.wait(120), tell(reason)),
                                                              daemon=True).start()
        return server

    monkeypatch.setattr(background, "uvicorn_server", uvicorn_server)
    yield held
    held.set()


def dead_server(served, base: str, reason: str, exit_held: threading.Event) -> None:
    """The engine is dead: /health 503 with the reason, a new request 503, then the server stops by itself."""
    status, state = health(base)
    assert status == 503 and state["status"] == "unavailable" and reason in state["reason"]
    status, body = completion(base, 3)
    assert status == 503 and "the engine has stopped" in body["error"]["message"]
    exit_held.set()
    assert eventually(lambda: gone(base))
    assert served.loop.dead and reason in served.loop.dead


def test_forwards_failing_in_a_row_stop_the_server(tiny, exit_held):
    served = server(tiny)
    failing_forwards(served.loop.engine, 10)
    with serving(served) as base:
        for _ in range(3):
            status, body = completion(base, 1)
            assert status == 500
        assert eventually(lambda: served.loop.dead)  # the third failure ends the engine
        m = idle(base)
        assert m["tfq_pages_free"] == POOL and m["tfq_lanes_busy"] == 0
        dead_server(served, base, "3 forwards failed in a row", exit_held)


def test_a_forward_that_leaves_the_engine_unservable_stops_the_server_at_once(tiny, exit_held):
    """A fault after which no forward can run (a tensor-parallel group torn down: tfq/parallel/ranks.py raises
    Unservable) ends the engine at its first forward, not the third."""
    served = server(tiny)
    real = served.loop.engine.runner.run

    def run(feeds):
        raise Unservable("a group torn down, put in by the test")

    served.loop.engine.runner.run = run
    with serving(served) as base:
        status, body = completion(base, 1)
        assert status == 500 and "a group torn down" in body["error"]["message"]
        assert eventually(lambda: served.loop.dead)
        dead_server(served, base, "a group torn down", exit_held)
    served.loop.engine.runner.run = real


def test_a_loop_thread_that_dies_answers_its_requests_and_stops_the_server(tiny, exit_held):
    served = server(tiny)
    loop = served.loop
    real = loop._observe

    def observe():
        if loop.engine.has_work() and any(st.digests for st in loop.engine.streams.values()):
            raise KeyError("a loop fault put in by the test")
        real()

    loop._observe = observe
    with serving(served) as base:
        status, body = completion(base, 1, max_tokens=40)
        assert status == 500 and "the engine loop failed: KeyError" in body["error"]["message"]
        assert eventually(lambda: not loop._thread.is_alive())
        engine = loop.engine
        assert engine.pages.unheld == POOL and all(lane is None for lane in engine.scheduler.lanes)
        dead_server(served, base, "the engine loop failed", exit_held)


def test_a_loop_thread_ended_by_a_panic_answers_and_stops_the_server(tiny, exit_held):
    """A BaseException (a Rust panic) out of a step ends the engine as any fault does: /health 503, requests
    answered, the server stops."""
    served = server(tiny)

    def step():
        raise Panic("a panic put in by the test")

    served.loop.engine.step = step
    with serving(served) as base:
        status, body = completion(base, 1)
        assert status == 500 and "the engine loop failed: Panic" in body["error"]["message"]
        dead_server(served, base, "the engine loop failed: Panic", exit_held)


def test_health_says_503_when_the_engine_thread_is_gone(tiny, exit_held):
    """Whatever ends the engine's thread, /health looks at the thread itself, not only at what it was told."""
    served = server(tiny)
    served.loop._loop = lambda: None  # the thread ends at once, telling nobody
    with serving(served) as base:
        assert eventually(lambda: not served.loop._thread.is_alive())
        dead_server(served, base, "the engine thread has ended", exit_held)


def test_a_stuck_step_is_caught_by_the_watchdog(tiny, exit_held):
    served = server(tiny, served={"stuck_after_s": 0.5})
    engine, release, entered = served.loop.engine, threading.Event(), threading.Event()
    real = engine.step

    def step():
        if any(st.digests for st in engine.streams.values()):
            entered.set()
            release.wait(120)  # stuck until the test lets go
        return real()

    engine.step = step
    try:
        with serving(served) as base:
            status, body = completion(base, 1)
            assert entered.is_set()
            assert status == 500 and "one step has run for over 0.5 s" in body["error"]["message"]
            dead_server(served, base, "one step has run for over 0.5 s", exit_held)
    finally:
        release.set()


def test_a_step_slow_by_its_learned_cost_is_not_stuck(tiny, monkeypatch):
    """A step past --stuck-after whose rows should take that long by the cost of steps learned here (a long prefill
    of a large model on a few cores) is slow, not stuck: the watchdog gives it 10 times what it should take."""
    served = server(tiny, served={"stuck_after_s": 0.3})
    engine, release = served.loop.engine, threading.Event()
    monkeypatch.setattr(engine.scheduler, "expected_seconds", lambda step: 30.0)  # as if learned on a slow machine
    real = engine.runner.run

    def run(feeds):
        release.wait(120)  # the first forward runs until the test lets go
        return real(feeds)

    monkeypatch.setattr(engine.runner, "run", run)
    try:
        with serving(served) as base:
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(completion, base, 1)
                assert eventually(lambda: health(base)[1].get("step_s", 0) > 1.0)  # over three times --stuck-after
                assert health(base)[0] == 200 and served.loop.dead is None
                release.set()
                assert answer.result()[0] == 200
            settled(base)
    finally:
        release.set()


def test_the_control_a_healthy_server_is_not_dead(tiny):
    """The health check's control: the same requests on a server without a fault leave it healthy and serving."""
    served = server(tiny, served={"stuck_after_s": 0.5})
    with serving(served) as base:
        for seed in (1, 2, 3):
            assert completion(base, seed)[0] == 200
        settled(base)
        assert not gone(base) and served.loop.dead is None


SERVE_WITH_A_DEAD_ENGINE = """
import sys
import tfq.engine.core
class Panic(BaseException):
    pass
def step(self):
    raise {fault}("an engine fault put in by the test")
tfq.engine.core.Engine.step = step
from tfq.cli import main
sys.argv = ["tfq", "serve", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("fault", ["RuntimeError", "Panic"])
def test_tfq_serve_exits_non_zero_when_its_engine_dies(tiny_dirs, fault):
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_A_DEAD_ENGINE.format(fault=fault),
                             "--model", str(tiny_dirs["qwen2"]), "--plan", TINY_PLAN, "--port", "0", "--quiet",
                             "--name", NAME, "--log-level", "error"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server ended before serving"
        base = "http://" + line.split("http://")[1].split("/v1")[0]
        status, body = completion(base, 1)
        assert status == 500 and f"the engine loop failed: {fault}" in body["error"]["message"]
        assert proc.wait(60) == 1
        err = proc.stderr.read()
        assert f"the engine stopped (the engine loop failed: {fault}: an engine fault" in err
        assert "ERROR tfq.serve.loop: the engine cannot serve" in err  # the log line, at --log-level error
    finally:
        proc.kill()


def test_a_fault_while_tokenizing_is_a_json_500_for_that_request_alone(tiny, monkeypatch):
    """The HTTP side's own faults (here the tokenizer, on the request's worker thread) answer that request with a
    one-line JSON 500, not a plain-text traceback; the next request is served."""
    served = server(tiny)
    real = served.tokenizer.encode

    def encode(text):
        if "canary" in text:
            raise TypeError("TextInputSequence must be str (a tokenizer fault put in by the test)")
        return real(text)

    monkeypatch.setattr(served.tokenizer, "encode", encode)
    with serving(served) as base:
        status, headers, body = raw(base, "POST", "/v1/completions",
                                    json.dumps({"model": NAME, "prompt": "a canary", "max_tokens": 2}).encode())
        error = json.loads(body)["error"]
        assert status == 500 and error["type"] == "server_error" and "TypeError" in error["message"]
        assert "\n" not in error["message"] and "Traceback" not in body.decode()
        assert completion(base, 1)[0] == 200
        settled(base)
