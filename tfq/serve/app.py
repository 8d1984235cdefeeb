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
from dataclasses import replace
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tfq.decode import tools
from tfq.decode.grammar import Constraint, Matcher
from tfq.engine.stream import Finish, Request, Result
from tfq.errors import TfqError
from tfq.receipts.receipt import Issuer
from tfq.serve.compiles import Compiles, Crowded, TooSlow
from tfq.serve.guard import Guard
from tfq.serve.intake import (
    ApiError,
    Served,
    chat_prompt,
    check_model,
    check_stops,
    error_body,
    text_prompts,
    validation_message,
)
from tfq.serve.loop import Busy, Dead, Done, Ticket, Token
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

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25


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
        choices = [text_choice(shape, served.tokenizer, i, r, owners[i], body.echo) | receipt(shape, requests[i], r)
                   for i, r in enumerate(results)]
        return shape.body(choices, usage=usage(sum(map(len, prompts)), sum(len(r.ids) for r in results)))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        check_model(served, body)
        check_stops(served, body)
        chat = await asyncio.to_thread(chat_prompt, served, body)
        prompt = chat.ids
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests, matchers = await shaped(served, compiles, body, salt(http), lambda: body.requests(
            [prompt], served.window, body.reply_tokens, logprobs, constraint=tool_grammar(served, body)))
        shape = Shape.new("chat", served.model, body.return_token_ids, body.return_digests, body.calling,
                          await issuer(served, body), chat.inside)
        ticket = submit(served, requests, matchers)
        if body.stream:
            return sse(served, ticket, chat_chunks(served, ticket, shape, len(prompt) if body.include_usage else None))
        results = await collect(served, ticket, http)
        choices = [chat_choice(shape, served.tokenizer, i, r) | receipt(shape, requests[i], r)
                   for i, r in enumerate(results)]
        return shape.body(choices, usage=usage(len(prompt), sum(len(r.ids) for r in results)))

    app.include_router(v1)
    return app


async def issuer(served: Served, body) -> Issuer | None:
    """Who signs the request's receipts, when it asks for them: the model's identity known first (a hash of its
    files, once a process), off the event loop."""
    if not body.receipt or served.issuer is None:
        return None
    await asyncio.to_thread(lambda: served.issuer.model)
    return served.issuer


def tool_grammar(served: Served, body: ChatBody) -> Constraint | None:
    """The grammar of tool_choice "required" or a named function (tfq/decode/tools.py); None otherwise."""
    if not body.calling:
        return None
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    return tools.constraint(body.tool_dicts, choice, body.parallel_tool_calls, served.tokenizer)


def salt(http: HttpRequest) -> str:
    """The cache salt of the request's key (tfq/serve/guard.py): its tenant's prefix-cache pages."""
    return getattr(http.state, "cache_salt", "")


async def shaped(served: Served, compiles: Compiles, body, cache_salt: str, make
                 ) -> tuple[list[Request], list[Matcher] | None]:
    """The body's engine requests (make()) with the tenant's cache salt, every setting checked, and their
    grammar's matchers (one a choice), compiled off the event loop and the engine's thread
    (tfq/serve/compiles.py)."""
    where = ("response_format" if body.response_format is not None else "tools" if getattr(body, "calling", False)
             else "structured_outputs")
    try:
        requests = make()
    except TfqError as e:  # a constraint malformed as data (two kinds, an empty choice)
        raise ApiError(400, f"{where}: {e}", where) from None
    requests = [replace(r, cache_salt=cache_salt) for r in requests] if cache_salt else requests
    try:
        requests[0].penalties.validate("logit_bias", served.vocab)
    except TfqError as e:
        raise ApiError(400, str(e), "logit_bias") from None
    try:
        for r in requests:  # the engine's own checks, here rather than in its thread
            r.validate()
    except TfqError as e:
        raise ApiError(400, str(e)) from None
    if len(requests) > served.loop.capacity:  # never fits, however long the client waits: not a 429
        raise ApiError(400, f"n: this request asks for {len(requests)} streams (prompts x n), more than this server "
                       f"holds at once ({served.loop.capacity}: lanes and queue); send fewer at a time", "n")
    constraint = requests[0].constraint
    if constraint is None:
        return requests, None
    try:
        return requests, await compiles.matchers(served.loop.engine.grammars, constraint, len(requests))
    except (TfqError, TooSlow) as e:
        raise ApiError(400, f"{where}: {e}", where) from None
    except Crowded as e:
        raise ApiError(429, f"the server is busy: {e}; retry after {RETRY_AFTER_S} s", None, "rate_limit_error",
                       outcome="busy") from None


def submit(served: Served, requests: list[Request], matchers: list[Matcher] | None = None) -> Ticket:
    try:
        ticket = served.loop.submit(requests, matchers)
    except Busy as e:
        raise ApiError(429, f"the server is busy: {e}; retry after {RETRY_AFTER_S} s", None, "rate_limit_error",
                       outcome="busy") from None
    except Dead as e:
        raise ApiError(503, f"the engine has stopped ({e}); the server is going down", None, "server_error",
                       outcome="failed") from None
    served.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in requests))
    if served.log_prompts:
        for r in requests:
            log.info("prompt of %d tokens: %r", len(r.prompt), served.tokenizer.decode(list(r.prompt)))
    return ticket


# -- results out -------------------------------------------------------------------------------------------
async def _disconnected(http: HttpRequest) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def collect(served: Served, ticket: Ticket, http: HttpRequest) -> list[Result]:
    """Every choice's result; a client gone before the end aborts them all."""
    results: list[Result | None] = [None] * len(ticket.requests)
    left = len(results)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        while left:
            event = asyncio.ensure_future(ticket.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                raise ApiError(499, "the client closed the request", outcome="aborted")
            got = event.result()
            if isinstance(got, Done):
                results[got.choice] = got.result
                left -= 1
    finally:
        gone.cancel()
        if left:
            served.loop.abort(ticket)
    return finished(served, results)


def finished(served: Served, results: list[Result]) -> list[Result]:
    for r in results:
        _check(r)
    served.metrics.outcome("aborted" if any(r.finish is Finish.ABORT for r in results) else "finished")
    return results


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


async def _events(ticket: Ticket) -> AsyncIterator[Token | Done]:
    left = len(ticket.requests)
    while left:
        event = await ticket.events.get()
        left -= isinstance(event, Done)
        yield event


def _ended(served: Served, shape: Shape, results: list[Result], usage_of: int | None):
    """After the last choice: the outcome counted, and the usage chunk when asked (`usage_of`: prompt tokens)."""
    finished(served, results)
    if usage_of is not None:
        return shape.body([], chunk=True, usage=usage(usage_of, sum(len(r.ids) for r in results)))
    return None


def _check(result: Result) -> Result:
    if result.finish is Finish.ERROR:
        raise ApiError(500 if result.fault else 400, result.error or "the stream failed",
                       kind="server_error" if result.fault else "invalid_request_error", outcome="failed")
    return result


async def chat_chunks(served: Served, ticket: Ticket, shape: Shape, usage_of: int | None) -> AsyncIterator[dict]:
    """A chat's chunks; a thinking model's thinking as `reasoning_content` deltas (tfq/decode/thinking.py); with
    tools, text from a call's `<tool_call>` on goes out as whole calls, and a call written whole in the thinking goes
    out as a call too (tfq/decode/tools.py)."""
    tok = served.tokenizer
    yield shape.body([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(len(ticket.requests))], chunk=True)
    results: list[Result | None] = [None] * len(ticket.requests)
    choices = [ChoiceStream(shape) for _ in ticket.requests]
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
    offsets = [0] * len(ticket.requests)
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
