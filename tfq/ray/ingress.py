"""The ingress: OpenAI's API on Ray Serve's HTTP proxy, each request relayed to a replica (tfq/ray/replica.py)
chosen by its prompt's first full page and by load (tfq/ray/router.py), its response streamed back as the replica's
app sends it. A request whose replica dies before answering is sent again to another one, not failed; a streamed
reply whose replica dies mid-way is resumed on another from the tokens already sent (tfq/ray/splice.py), and the
client's stream goes on with the bits it would have had.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at run time.)
"""

import asyncio
import json
import logging
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from tfq.ray.replica import ReplicaSpec
from tfq.ray.routing import route_key
from tfq.ray.splice import DONE, Splice
from tfq.serve.guard import host_name

log = logging.getLogger(__name__)
PATIENCE_S = 120.0  # how long a request waits for a replica that answers: its first, or one to resume it on
GONE = (RayActorError, ActorUnavailableError)  # a replica died, or stopped answering
app = FastAPI(title="tfq on Ray", docs_url=None, redoc_url=None)


def parsed(body: bytes) -> Optional[dict]:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def prompt_ids(tokenizer, path: str, doc: Optional[dict]) -> Optional[list[int]]:
    """The prompt's ids as the replica will make them, or None where the body is not one the router can read (the
    replica then answers it: a refusal, or a prompt the router just does not place)."""
    from tfq.serve.protocol import ChatBody

    try:
        if path.endswith("chat/completions"):
            chat = ChatBody(**doc)
            return list(tokenizer.ids(tokenizer.chat(chat.chat(), tools=chat.tool_dicts,
                                                     options=chat.chat_template_kwargs)))
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        return list(prompt) if isinstance(prompt, list) else list(tokenizer.encode(prompt))
    except Exception:  # noqa: BLE001 (anything unreadable is the replica's to refuse)
        return None


def resumable(path: str, doc: Optional[dict]) -> Optional[Splice]:
    """A Splice for a streamed reply the ingress can resume on another replica (one choice of one prompt, no echo or
    receipt: tfq.serve.intake.check_resume), else None."""
    prompt = doc.get("prompt") if doc else None
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int) and len(prompt) != 1
    if not doc or not path.endswith("completions") or doc.get("stream") is not True or doc.get("n", 1) != 1 \
            or several or doc.get("echo") or doc.get("receipt") or doc.get("resume_token_ids"):
        return None
    return Splice(wants_ids=doc.get("return_token_ids") is True)


def error_event(message: str) -> bytes:
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': None}})}"\
        f"\n\n".encode() + DONE


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas, spec: ReplicaSpec, hosts: Optional[frozenset] = None):
        """hosts: the Host names answered (tfq.serve.guard.allowed_hosts; None: any)."""
        from tfq.model.source import resolve_model
        from tfq.model.tokenizer import Tokenizer
        from tfq.plan.resolve import resolve_plan

        self.replicas, self.hosts = replicas, hosts
        plan = resolve_plan(spec.plan, spec.model, list(spec.sets), True, None)[0]
        self.tokenizer = Tokenizer.from_folder(resolve_model(plan.model, progress=False, weights=False))
        self.facts: Optional[dict] = None
        self.requeued = 0  # requests sent again because their replica died before answering
        self.moved = 0  # streams resumed on another replica because theirs died mid-reply

    async def _facts(self) -> dict:
        if self.facts is None:
            self.facts = await self.replicas.facts.remote()
        return self.facts

    @app.get("/health")
    async def health(self) -> JSONResponse:
        facts = await self._facts()
        return JSONResponse({"status": "ok", "model": facts["model"], "self_check": facts["reference"],
                             "requeued": self.requeued, "moved": self.moved})

    def counters(self) -> bytes:
        """The ingress's own counts in Prometheus' text format."""
        lines = []
        for name, value, what in (("tfq_ray_streams_moved_total", self.moved,
                                   "streamed replies resumed on another replica after theirs died"),
                                  ("tfq_ray_requests_requeued_total", self.requeued,
                                   "requests sent again because their replica died before answering")):
            lines += [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {float(value)}"]
        return ("\n".join(lines) + "\n").encode()

    async def _start(self, call: tuple, body: bytes, key: Optional[str]):
        """(the replica's Head, the rest of its stream) from the first replica that answers, or (None, None) when
        none has in PATIENCE_S (replicas that died are restarted by Ray Serve meanwhile)."""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            stream = self.replicas.options(stream=True).relay.remote(*call, body, route=key)
            try:
                return await stream.__anext__(), stream
            except GONE as e:  # died before it answered: the request has not started
                self.requeued += 1
                log.warning("a replica died before answering (%s); sending the request again", type(e).__name__)
                await asyncio.sleep(0.5)  # back off while Ray Serve notices and replaces it
        return None, None

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def relay(self, request: Request, path: str):
        body = await request.body()
        facts = await self._facts()
        doc = parsed(body) if request.method == "POST" else None
        if self.hosts is not None and host_name(request.headers.get("host", "")) not in self.hosts:
            names = ", ".join(sorted(self.hosts))
            return JSONResponse({"error": {"message": f"Host {request.headers.get('host', '')!r} is not a name this "
                                           f"server answers to ({names}); start it with --allowed-host NAME",
                                           "type": "invalid_request_error", "param": None, "code": None}}, 421)
        ids = await asyncio.to_thread(prompt_ids, self.tokenizer, path, doc) if doc else None
        key = route_key(ids, facts["page_rows"]) if ids else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        call = (request.method, "/" + path, request.url.query, headers)
        splice = resumable(path, doc)
        head, stream = await self._start(call, json.dumps({**doc, "return_token_ids": True}).encode()
                                         if splice else body, key)
        if head is None:
            return JSONResponse({"error": {"message": f"no replica answered in {PATIENCE_S:.0f} s",
                                           "type": "server_error", "param": None, "code": None}}, 503)
        kept = {k: v for k, v in head.headers if k.lower() not in ("content-length", "transfer-encoding")}
        if path == "metrics" and head.status == 200:  # the replica's (its key checked there), then the ingress's
            return Response(b"".join([chunk async for chunk in stream]) + self.counters(), headers=kept)
        if splice is None or head.status != 200:
            events = kept.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(self._as_sent(stream, events), status_code=head.status, headers=kept)
        return StreamingResponse(self._spliced(stream, splice, call, doc, key), status_code=head.status, headers=kept)

    @staticmethod
    async def _as_sent(stream, events: bool):
        """A response as the replica sends it; `events` (server-sent events) that lose their replica end with an
        error event (a stream this ingress does not resume: several choices, echo, a receipt, the Responses API)."""
        try:
            async for chunk in stream:
                yield chunk
        except GONE:
            if not events:
                raise
            yield error_event("the replica serving this stream died; it is not one the ingress resumes (one choice of "
                              "one prompt, no echo, no receipt): send it again")

    async def _spliced(self, stream, splice: Splice, call: tuple, doc: dict, key: Optional[str]):
        """The reply's events; where its replica dies before the end, the reply resumed on another replica from the
        tokens sent so far, joined on (tfq/ray/splice.py)."""
        while True:
            try:
                async for chunk in stream:
                    for event in splice.feed(chunk):
                        yield event
                return
            except GONE as e:
                if splice.ended:
                    return
                if splice.finished:  # only the end was lost: the reply is whole
                    yield DONE
                    return
                self.moved += 1
                log.warning("a replica died mid-reply (%s); resuming it after %d tokens", type(e).__name__,
                            len(splice.ids))
                splice.resume()
                head, stream = await self._start(call, json.dumps(
                    {**doc, "return_token_ids": True, "resume_token_ids": splice.ids}).encode(), key)
                if head is None or head.status != 200:
                    detail = f"status {head.status}" if head else f"none answered in {PATIENCE_S:.0f} s"
                    yield error_event(f"the replica serving this reply died and it could not be resumed ({detail})")
                    return
