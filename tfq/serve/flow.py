"""A request's way through the engine loop, which every route shares: its requests shaped and checked, submitted,
their events read, their results collected (a client gone aborts them) and checked."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request as HttpRequest

from tfq.decode import tools
from tfq.decode.grammar import Constraint, Matcher
from tfq.engine.stream import Finish, Request, Result
from tfq.errors import TfqError
from tfq.receipts.receipt import Issuer
from tfq.serve.compiles import Compiles, Crowded, TooSlow
from tfq.serve.intake import ApiError, Served
from tfq.serve.loop import Busy, Dead, Done, Ticket, Token
from tfq.serve.protocol import ChatBody

log = logging.getLogger("tfq.serve.app")  # the routes' logger: refusals, prompts (docs/serve.md, Logs)

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25


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


async def _events(ticket: Ticket) -> AsyncIterator[Token | Done]:
    left = len(ticket.requests)
    while left:
        event = await ticket.events.get()
        left -= isinstance(event, Done)
        yield event


def _check(result: Result) -> Result:
    if result.finish is Finish.ERROR:
        raise ApiError(500 if result.fault else 400, result.error or "the stream failed",
                       kind="server_error" if result.fault else "invalid_request_error", outcome="failed")
    return result
