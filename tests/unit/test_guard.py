"""The guard without a server: tfq/serve/guard.py's Guard driven with ASGI scope dicts and receive callables, as
uvicorn drives it. The Host, the key and the Content-Type are decided from the request line and headers alone
(`check`); the body is read up to the limit and no further (`read_body`); a refusal never reaches the app.
tests/test_hostile.py sends the same kinds of requests to a running server."""
from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from tfq.serve.guard import Guard, Limits, allowed_hosts, cache_salts

KEY, OTHER = "sesame", "open-up"


def guard(keys: tuple[str, ...] = (KEY,), body_bytes: int = 100, hosts=allowed_hosts("127.0.0.1"),
          app=None) -> Guard:
    outcomes: list[str] = []
    g = Guard(app, Limits(body_bytes=body_bytes), keys, hosts, outcomes.append)
    g.outcomes = outcomes  # what the metrics would count
    return g


def scope(path: str = "/v1/chat/completions", method: str = "POST", **headers: str) -> dict:
    """An ASGI scope (headers given as content_type="..." for Content-Type)."""
    named = {"host": "127.0.0.1:8000", "content-type": "application/json",
             **{k.replace("_", "-"): v for k, v in headers.items()}}
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in named.items()]}


def checked(g: Guard, s: dict):
    """Guard.check as __call__ calls it: the headers lower-cased."""
    return g.check(s, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in s["headers"]})


def bearer(key: str) -> str:
    return f"Bearer {key}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics"])
@pytest.mark.parametrize("authorization", [None, bearer("wrong"), bearer(KEY + " "), KEY, bearer(KEY.upper())])
def test_a_wrong_or_missing_key_is_401_on_v1_and_metrics(path, authorization):
    g = guard()
    s = scope(path, "GET" if path in ("/v1/models", "/metrics") else "POST",
              **({} if authorization is None else {"authorization": authorization}))
    refusal = checked(g, s)
    assert refusal is not None and refusal.status == 401 and refusal.kind == "authentication_error"
    assert "API key" in json.loads(refusal.body())["error"]["message"]
    assert "cache_salt" not in s.get("state", {})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/metrics"])
def test_the_right_key_passes_and_one_key_shares_the_cache(path):
    s = scope(path, authorization=bearer(KEY))
    assert checked(guard(), s) is None
    assert s["state"]["cache_salt"] == ""  # one key: every stream shares prefix-cache pages, as without keys


def test_with_several_keys_each_key_is_a_tenant_of_its_own_salt():
    g = guard(keys=(KEY, OTHER))
    salts = []
    for key in (KEY, OTHER):
        s = scope(authorization=bearer(key))
        assert checked(g, s) is None
        salts.append(s["state"]["cache_salt"])
    assert salts[0] != salts[1] and all(salts)
    assert salts == [hashlib.sha256(k.encode()).hexdigest()[:32] for k in (KEY, OTHER)]
    assert not any(k in salt for k in (KEY, OTHER) for salt in salts)  # the key is never in a cache's names
    assert cache_salts((KEY,)) == {KEY: ""} and cache_salts(()) == {}
    assert checked(g, scope(authorization=bearer("third"))).status == 401


def test_health_is_open_and_without_keys_everything_is():
    assert checked(guard(), scope("/health", "GET")) is None
    s = scope()
    assert checked(guard(keys=()), s) is None and "state" not in s


@pytest.mark.parametrize("host, status", [
    ("evil.example", 421), ("127.0.0.1.evil.example:80", 421), ("", 421),
    ("localhost:1234", None), ("[::1]:8000", None), ("127.0.0.1", None),
])
def test_a_loopback_server_answers_its_loopback_names_only(host, status):
    refusal = checked(guard(), scope(host=host, authorization=bearer(KEY)))
    assert (refusal and refusal.status) == status
    assert checked(guard(hosts=allowed_hosts("0.0.0.0")), scope(host=host, authorization=bearer(KEY))) is None


@pytest.mark.parametrize("kind, status", [
    ("application/json", None), ("application/json; charset=utf-8", None), ("Application/JSON", None),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("", 415),
])
def test_a_post_to_the_api_is_json(kind, status):
    refusal = checked(guard(), scope(authorization=bearer(KEY), content_type=kind))
    assert (refusal and refusal.status) == status


def receiving(messages: list[dict]):
    """A receive that gives these messages, noting how many were taken; past them, the test fails."""
    taken = []

    async def receive() -> dict:
        assert len(taken) < len(messages), "read past the messages"
        taken.append(messages[len(taken)])
        return taken[-1]

    return receive, taken


def read(g: Guard, messages: list[dict], **headers: str):
    receive, taken = receiving(messages)
    body, refusal = asyncio.run(g.read_body(receive, headers))
    return body, refusal, len(taken)


def chunk(data: bytes, more: bool = True) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_body_at_the_limit_is_read_whole():
    assert read(guard(), [chunk(b"x" * 60), chunk(b"y" * 40, more=False)]) == (b"x" * 60 + b"y" * 40, None, 2)


def test_a_body_over_the_limit_is_413_and_unread_past_it():
    """Sent in chunks: refused at the chunk that passes the limit, the rest never read; declared: refused
    before any of it is read."""
    body, refusal, taken = read(guard(), [chunk(b"x" * 60), chunk(b"y" * 41), chunk(b"z" * 10, more=False)])
    assert body == b"" and refusal.status == 413 and taken == 2
    assert "limit of 100 bytes" in refusal.message and (b"connection", b"close") in refusal.headers
    body, refusal, taken = read(guard(), [], **{"content-length": "101"})
    assert refusal.status == 413 and taken == 0
    assert read(guard(), [chunk(b"x" * 100, more=False)], **{"content-length": "100"})[1] is None  # at the limit


@pytest.mark.parametrize("declared", ["-5", "1e3", "0x10", " 10"])
def test_a_content_length_not_a_number_is_400(declared):
    body, refusal, taken = read(guard(), [], **{"content-length": declared})
    assert refusal.status == 400 and taken == 0


def test_a_client_gone_while_sending_is_499():
    body, refusal, taken = read(guard(), [chunk(b"x" * 10), {"type": "http.disconnect"}])
    assert refusal.status == 499 and refusal.outcome == "aborted" and taken == 2


def called(g: Guard, s: dict, messages: list[dict]) -> list[dict]:
    """What the guard sends back for one request through __call__."""
    receive, _ = receiving(messages)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(g(s, receive, send))
    return sent


def test_a_refusal_never_reaches_the_app_and_a_passed_request_gets_its_body_again():
    reached: list[tuple[dict, bytes]] = []

    async def app(s, receive, send):
        reached.append((s, (await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})

    g = guard(app=app)
    sent = called(g, scope(authorization=bearer(KEY)), [chunk(b"x" * 101, more=False)])
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["message"].startswith("the body is over")
    sent = called(g, scope(authorization=bearer("wrong")), [chunk(b"{}", more=False)])
    assert sent[0]["status"] == 401 and not reached and g.outcomes == ["invalid", "unauthorized"]
    sent = called(g, scope(authorization=bearer(KEY)), [chunk(b'{"a"'), chunk(b": 1}", more=False)])
    assert sent[0]["status"] == 200 and reached[0][1] == b'{"a": 1}'
    assert reached[0][0]["state"]["cache_salt"] == ""
