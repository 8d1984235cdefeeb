"""The ingress: OpenAI's API on Ray Serve's HTTP proxy, each request relayed to a replica (tfq/ray/replica.py)
chosen by its prompt's first full page and by load (tfq/ray/router.py), its response streamed back as the replica's
app sends it. A request whose replica dies before answering is sent again to another one, not failed.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at run time.)
"""

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from tfq.ray.replica import Head, ReplicaSpec
from tfq.ray.routing import route_key

log = logging.getLogger(__name__)
TRIES = 3  # replicas a request that has not started is offered to
app = FastAPI(title="tfq on Ray", docs_url=None, redoc_url=None)


def prompt_ids(tokenizer, path: str, body: bytes) -> Optional[list[int]]:
    """The prompt's ids as the replica will make them, or None where the body is not one the router can read (the
    replica then answers it: a refusal, or a prompt the router just does not place)."""
    from tfq.serve.protocol import ChatBody

    try:
        doc = json.loads(body)
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


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas, spec: ReplicaSpec):
        from tfq.model.source import resolve_model
        from tfq.model.tokenizer import Tokenizer
        from tfq.plan.resolve import resolve_plan

        self.replicas = replicas
        plan = resolve_plan(spec.plan, spec.model, list(spec.sets), True, None)[0]
        self.tokenizer = Tokenizer.from_folder(resolve_model(plan.model, progress=False, weights=False))
        self.facts: Optional[dict] = None
        self.requeued = 0  # requests sent again because their replica died before answering

    async def _facts(self) -> dict:
        if self.facts is None:
            self.facts = await self.replicas.facts.remote()
        return self.facts

    @app.get("/health")
    async def health(self) -> JSONResponse:
        facts = await self._facts()
        return JSONResponse({"status": "ok", "model": facts["model"], "self_check": facts["reference"],
                             "requeued": self.requeued})

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def relay(self, request: Request, path: str):
        body = await request.body()
        facts = await self._facts()
        ids = prompt_ids(self.tokenizer, path, body) if request.method == "POST" else None
        key = route_key(ids, facts["page_rows"]) if ids else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        for attempt in range(TRIES):
            stream = self.replicas.options(stream=True).relay.remote(
                request.method, "/" + path, request.url.query, headers, body, route=key)
            try:
                head = await stream.__anext__()
                break
            except RayActorError as e:  # died before it answered: the request has not started
                self.requeued += 1
                log.warning("a replica died before answering (%s); sending the request again", e)
                if attempt == TRIES - 1:
                    return JSONResponse({"error": {"message": f"no replica answered in {TRIES} tries",
                                                   "type": "server_error", "param": None, "code": None}}, 503)
        assert isinstance(head, Head)

        async def rest():
            async for chunk in stream:
                yield chunk

        kept = {k: v for k, v in head.headers if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=head.status, headers=kept)
