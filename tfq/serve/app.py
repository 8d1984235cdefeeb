"""The FastAPI app: OpenAI's routes over one engine loop, OpenAI-style errors, and /health.

Every refusal is one JSON body `{"error": {"message", "type", "param", "code"}}` with a 4xx status (docs/serve.md
lists them): what is checked before the body is parsed is tfq/serve/guard.py, what is checked of a parsed
request tfq/serve/intake.py. A client that goes away aborts its streams at the next step; nothing else in the
batch notices.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tfq.engine.stream import Result, shown_after_resumed
from tfq.serve.compiles import Compiles
from tfq.serve.flow import (
    RETRY_AFTER_S,
    _check,
    _events,
    collect,
    finished,
    issuer,
    salt,
    shaped,
    submit,
    tool_grammar,
)
from tfq.serve.guard import Guard
from tfq.serve.intake import (
    ApiError,
    Served,
    chat_prompt,
    check_model,
    check_resume,
    check_stops,
    error_body,
    text_prompts,
    validation_message,
)
from tfq.serve.loop import Ticket, Token
from tfq.serve.protocol import ChatBody, CompletionBody
from tfq.serve.replies import (
    ChoiceStream,
    Shape,
    chat_choice,
    chat_logprobs,
    extensions,
    finish_reason,
    receipt,
    text_choice,
    text_logprobs,
    usage,
)
from tfq.serve.respond import responses_route

log = logging.getLogger(__name__)



def build_app(served: Served) -> FastAPI:
    compiles = Compiles()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        served.loop.start()
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: whatever still runs is aborted
            served.loop.stop()
            compiles.close()

    # /openapi.json describes every route and field; the Swagger and ReDoc pages are off, since they load
    # their scripts from the internet
    app = FastAPI(title="tfq", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Exact inference, OpenAI-compatible: a reply does not depend on what else is in flight.")
    metrics = served.metrics
    app.add_middleware(Guard, limits=served.limits, api_keys=served.api_keys, hosts=served.hosts,
                       outcome=metrics.outcome)

    # -- errors ------------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, e: ApiError):
        metrics.outcome(e.outcome)
        log.info("refused %d%s: %s", e.status, f" ({e.param})" if e.param else "", e.message)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HttpRequest, e: RequestValidationError):
        metrics.outcome("invalid")
        message, param = validation_message(e.errors())
        log.info("refused 400: %s", message)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(RecursionError)
    async def too_deep(_: HttpRequest, e: RecursionError):
        metrics.outcome("invalid")
        return JSONResponse(error_body("the body nests deeper than this server parses; send a flatter JSON body",
                                       "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def fault(http: HttpRequest, e: Exception):  # a bug of ours: one line for the client, the trace in the log
        log.exception("%s %s failed", http.method, http.url.path)
        metrics.outcome("failed")
        return JSONResponse(error_body(f"the server failed on this request: {type(e).__name__}", "server_error"),
                            status_code=500)

    v1 = APIRouter(prefix="/v1")  # the key is checked before the body is read (tfq.serve.guard)

    # -- routes ------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        ok, state = served.loop.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", **state}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0, "owned_by": "tfq",
                                            "max_model_len": served.window}]}

    @v1.post("/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        check_model(served, body)
        check_stops(served, body)
        prompts = await asyncio.to_thread(text_prompts, served, body.prompt, body.parse_special_tokens)
        check_resume(served, body, prompts)
        if body.stream and body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is returned whole; set stream to false", "stream")
        requests, matchers = await shaped(served, compiles, body, salt(http), lambda: body.requests(
            prompts, served.window, body.max_tokens, body.logprobs, body.logprobs if body.echo else None))
        shape = Shape.new("text", served.model, body.return_token_ids, body.return_digests,
                          issuer=await issuer(served, body))
        ticket = submit(served, requests, matchers)
        owners = [prompts[i // body.n] for i in range(len(requests))]
        if body.stream:
            return sse(served, ticket, text_chunks(served, ticket, shape, owners, body.echo,
                                                       sum(map(len, prompts)) if body.include_usage else None))
        results = await collect(served, ticket, http)
        return await whole(lambda: shape.body(
            [text_choice(shape, served.tokenizer, i, r, owners[i], body.echo) | receipt(shape, requests[i], r)
             for i, r in enumerate(results)], usage=usage(sum(map(len, prompts)), sum(len(r.ids) for r in results))))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        check_model(served, body)
        check_stops(served, body)
        chat = await asyncio.to_thread(chat_prompt, served, body)
        prompt = chat.ids
        check_resume(served, body, [prompt])
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests, matchers = await shaped(served, compiles, body, salt(http), lambda: body.requests(
            [prompt], served.window, body.reply_tokens, logprobs, constraint=tool_grammar(served, body)))
        shape = Shape.new("chat", served.model, body.return_token_ids, body.return_digests, body.calling,
                          await issuer(served, body), chat.inside)
        ticket = submit(served, requests, matchers)
        if body.stream:
            return sse(served, ticket, chat_chunks(served, ticket, shape, len(prompt) if body.include_usage else None))
        results = await collect(served, ticket, http)
        return await whole(lambda: shape.body(
            [chat_choice(shape, served.tokenizer, i, r) | receipt(shape, requests[i], r)
             for i, r in enumerate(results)], usage=usage(len(prompt), sum(len(r.ids) for r in results))))

    responses_route(v1, served, compiles)
    app.include_router(v1)
    return app


# -- results out -------------------------------------------------------------------------------------------
async def whole(build: Callable[[], dict]) -> JSONResponse:
    """A whole response's body built and written out off the event loop: a big one (16 choices of an echoed prompt
    with its scores: 0.1 s on an idle 2-core machine) would hold every streamed reply's tokens for as long."""
    return await asyncio.to_thread(lambda: JSONResponse(build()))


def sse(served: Served, ticket: Ticket, chunks: AsyncIterator[dict]):
    """Server-sent events: each chunk a `data:` line, an error as one, then `[DONE]`. A client that
    disconnects cancels the generator; its streams are aborted."""
    async def events():
        completed = False
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, allow_nan=False)}\n\n"
            completed = True
        except ApiError as e:
            served.metrics.outcome(e.outcome)
            yield f"data: {json.dumps(error_body(e.message, e.kind, e.param))}\n\n"
            completed = True
        finally:
            served.loop.abort(ticket)  # the choices still running, if any (a finished one is left alone)
            if not completed:
                served.metrics.outcome("aborted")
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _ended(served: Served, shape: Shape, results: list[Result], usage_of: int | None):
    """After the last choice: the outcome counted, and the usage chunk when asked (`usage_of`: prompt tokens)."""
    finished(served, results)
    if usage_of is not None:
        return shape.body([], chunk=True, usage=usage(usage_of, sum(len(r.ids) for r in results)))
    return None


async def chat_chunks(served: Served, ticket: Ticket, shape: Shape, usage_of: int | None) -> AsyncIterator[dict]:
    """A chat's chunks; a thinking model's thinking as `reasoning_content` deltas (tfq/decode/thinking.py); with
    tools, text from a call's `<tool_call>` on goes out as whole calls, and a call written whole in the thinking goes
    out as a call too (tfq/decode/tools.py)."""
    tok = served.tokenizer
    yield shape.body([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(len(ticket.requests))], chunk=True)
    results: list[Result | None] = [None] * len(ticket.requests)
    choices = [ChoiceStream(shape) for _ in ticket.requests]
    for stream, request in zip(choices, ticket.requests):  # a resumed reply: its thinking and calls so far, unsent
        if request.resumed:
            stream.feed(shown_after_resumed(request, tok.stream(), served.loop.engine.eos_ids, served.window))
    async for event in _events(ticket):
        i = event.choice
        if isinstance(event, Token):
            out = event.output
            lp = None if out.logprob is None else chat_logprobs(tok, [out.logprob])
            yield shape.body([{"index": i, "delta": choices[i].feed(out.text), "logprobs": lp, "finish_reason": None,
                               **extensions(shape, [out.token], [out.digest])}], chunk=True)
        else:
            results[i] = _check(event.result)
            delta = choices[i].finish()
            reason = finish_reason(event.result)
            reason = "tool_calls" if choices[i].calls and reason == "stop" else reason
            yield shape.body([{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason,
                               **receipt(shape, ticket.requests[i], event.result)}], chunk=True)
    last = _ended(served, shape, results, usage_of)
    if last is not None:
        yield last


async def text_chunks(served: Served, ticket: Ticket, shape: Shape, owners: list[list[int]], echo: bool,
                      usage_of: int | None) -> AsyncIterator[dict]:
    tok = served.tokenizer
    if echo:
        yield shape.body([{"index": i, "text": tok.decode(p), "logprobs": None, "finish_reason": None}
                          for i, p in enumerate(owners)], chunk=True)
    results: list[Result | None] = [None] * len(ticket.requests)
    offsets = [sum(len(tok.decode([t])) for t in r.resumed) for r in ticket.requests]  # after a resumed reply's
    async for event in _events(ticket):
        if isinstance(event, Token):
            out, i = event.output, event.choice
            lp = None if out.logprob is None else text_logprobs(tok, [out.token], [out.logprob], offsets[i])
            offsets[i] += len(tok.decode([out.token]))
            yield shape.body([{"index": i, "text": out.text, "logprobs": lp, "finish_reason": None,
                               **extensions(shape, [out.token], [out.digest])}], chunk=True)
        else:
            i = event.choice
            results[i] = _check(event.result)
            yield shape.body([{"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason(event.result),
                               **receipt(shape, ticket.requests[i], event.result)}], chunk=True)
    last = _ended(served, shape, results, usage_of)
    if last is not None:
        yield last
