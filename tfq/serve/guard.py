"""What a request must pass before any of it is parsed: the Host it names, its key, its Content-Type and its
body's size. An ASGI layer under FastAPI, so a refusal costs neither the body's bytes nor a JSON parse.

With keys set, /v1/ and /metrics need one (the metrics count prefix-cache hits, which would tell whether someone
sent a prompt). Each key is a tenant when there are several: the key's cache salt goes to the routes in the
scope's state, and its streams share prefix-cache pages only with its own (one key: every stream shares).

It is a plain ASGI wrapper, not Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from the
routes. The body is read here (at most `Limits.body_bytes`) and handed on whole; after it, `receive` is the
client's own, so the routes still see a disconnect.
"""
from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Limits:
    """Request limits a server operator sets (`tfq serve --max-...`); docs/serve.md states each."""

    body_bytes: int = 8 * 2**20  # a request body, checked before it is parsed
    prompt_tokens: int = 0  # a prompt's tokens; 0: what the window leaves for one reply token
    stop_chars: int = 1000  # one stop string's characters: held-back text costs up to this squared a token


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    kind: str = "invalid_request_error"
    outcome: str = "invalid"
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.kind, "param": None,
                                     "code": None}}).encode()


def allowed_hosts(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names a server answers: a loopback server only its loopback names (so a web page cannot reach it
    through a rebound DNS name), plus any given; None (any name) for a server bound to other addresses, unless
    names are given."""
    if bound.strip("[]") in LOOPBACK:
        return LOOPBACK | {bound.strip("[]")} | set(extra)
    return frozenset(extra) or None


def host_name(header: str) -> str:
    """`example.com:8000` -> `example.com`; `[::1]:8000` -> `::1`."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def cache_salts(keys: tuple[str, ...]) -> dict[str, str]:
    """Each key's prefix-cache salt: none for a single key (its streams are every stream), else one a key (a
    hash: the key itself is never kept in a cache's names)."""
    if len(keys) < 2:
        return {k: "" for k in keys}
    return {k: hashlib.sha256(k.encode()).hexdigest()[:32] for k in keys}


class Guard:
    def __init__(self, app, limits: Limits, api_keys: tuple[str, ...], hosts: frozenset[str] | None,
                 outcome: Callable[[str], None]):
        self.app, self.limits, self.hosts, self.outcome = app, limits, hosts, outcome
        self.salts = cache_salts(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.check(scope, headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self.read_body(receive, headers)
            if refusal is None:
                receive = replay(body, receive)
        if refusal is not None:
            log.info("refused %d %s %s: %s", refusal.status, scope["method"], scope["path"], refusal.message)
            self.outcome(refusal.outcome)
            return await respond(send, refusal)
        await self.app(scope, receive, send)

    def check(self, scope: Scope, headers: dict[str, str]) -> Refusal | None:
        """Everything decided by the request line and headers alone."""
        host = host_name(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            names = ", ".join(sorted(self.hosts))
            return Refusal(421, f"Host {host!r} is not a name this server answers to ({names}); "
                           f"start it with --allowed-host {host or 'NAME'} to serve that name")
        api = scope["path"].startswith("/v1/")
        if not (api or scope["path"] == "/metrics"):
            return None
        if self.salts:
            key = self.key_of(headers.get("authorization", ""))
            if key is None:
                return Refusal(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with one of the "
                               "server's --api-key", kind="authentication_error", outcome="unauthorized")
            scope.setdefault("state", {})["cache_salt"] = self.salts[key]
        if api and scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return Refusal(415, f"Content-Type {kind or 'missing'}: send the body as application/json")
        return None

    def key_of(self, authorization: str) -> str | None:
        """The server's key the header carries (every key compared in constant time), or None."""
        found = None
        for key in self.salts:
            if secrets.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
                found = key
        return found

    async def read_body(self, receive: Receive, headers: dict[str, str]) -> tuple[bytes, Refusal | None]:
        """The whole body, or a refusal as soon as it is known to be over the limit (unread past it)."""
        most = self.limits.body_bytes
        too_big = Refusal(413, f"the body is over this server's limit of {most} bytes; send less, or start the "
                          f"server with a larger --max-body-bytes", headers=((b"connection", b"close"),))
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > most):
            return b"", too_big if declared.isdigit() else Refusal(400, "Content-Length is not a number of bytes")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", Refusal(499, "the client closed the request", outcome="aborted")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > most:
                return b"", too_big
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), None


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then the client's own messages (a disconnect)."""
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def respond(send: Send, refusal: Refusal) -> None:
    body = refusal.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *refusal.headers]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
