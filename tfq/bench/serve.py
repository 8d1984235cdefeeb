"""`tfq bench serve`: the OpenAI-compatible server (tfq/serve/) under the official `openai` client.

For each concurrency level a fresh engine is served in this process (tfq.serve.background), so levels share
nothing but the weights. One untimed warm-up request goes first; then N chat completions from the suite
(cycling through its chats; greedy, a fixed max_tokens, streamed with usage), at most `concurrency` in flight
at once. The client records, per request, the time to its first token (TTFT), each gap between tokens (TBT)
and the output tokens the usage chunk reports; per level the wall time from the first request sent to the
last reply read. Exactness rides along: every reply must equal its chat's reply at concurrency 1.

Client and server share this process (and its GIL), as the tests' servers do: the figures include the
client's own parsing, a few percent of a step on a real model.
"""
from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tfq.bench.settings import parse_counts
from tfq.errors import TfqError
from tfq.suite import Chat

DEFAULT_CONCURRENCY = (1, 4, 8, 16)
LEAST_REQUESTS = 4  # the default requests a level: 2x its concurrency, at least this many
TIMEOUT_S = 3600.0  # a request may wait long behind others on a slow machine; the bench is not a timeout test


@dataclass(frozen=True)
class ServeSettings:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests_per_level: int | None = None  # None: 2x the level's concurrency, at least LEAST_REQUESTS
    max_tokens: int = 32
    threads: int | None = None  # exactly N torch threads; None: tfq's thread policy

    def requests_at(self, concurrency: int) -> int:
        return self.requests_per_level or max(LEAST_REQUESTS, 2 * concurrency)


@dataclass(frozen=True)
class Target:
    """What each level serves: the plan, its layout, the model loaded once, and the model's name in the API."""

    plan: object  # tfq.plan.Plan
    layout: object  # tfq.plan.Layout
    loaded: object  # tfq.model.load.LoadedModel
    name: str


@dataclass(frozen=True)
class SuiteSent:
    """The suite a run sends: its file, the chats that fit the window, and those left out with why
    (fitting_chats)."""

    path: str
    chats: list[Chat]
    left_out: list[dict]


@dataclass
class Reply:
    """One request as the client saw it."""

    chat: int  # index into the chats sent
    text: str = ""
    ttft_s: float | None = None  # None: no token came (cannot happen with max_tokens >= 1, but never divide by it)
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens
    output_tokens: int = 0  # from the usage chunk
    wall_s: float = 0.0
    finish: str | None = None


@dataclass
class Level:
    concurrency: int
    replies: list[Reply]
    wall_s: float  # first request sent to last reply read (the warm-up left out)


@dataclass(frozen=True)
class Listener:
    """What run_levels tells as it goes (the CLI's progress bar); by default nothing."""

    level: Callable[[str], None] = lambda what: None  # a level (or the reference) begins
    reply: Callable[[], None] = lambda: None  # a request got its whole reply


# ------------------------------------------------------------------------------------------ bad input

def parse_concurrency(text: str) -> tuple[int, ...]:
    return parse_counts(text, "--concurrency", "level", "levels (requests in flight)", "one request in flight",
                        "1,4,8,16")


def check_serve_settings(s: ServeSettings) -> None:
    """Bad numbers, refused before anything loads."""
    if s.max_tokens < 1:
        raise TfqError(f"--max-tokens must be at least 1, got {s.max_tokens}")
    if s.threads is not None and s.threads < 1:
        raise TfqError(f"--threads must be at least 1, got {s.threads}")
    if s.requests_per_level is not None:
        top = max(s.concurrency)
        if s.requests_per_level < top:
            raise TfqError(f"--requests-per-level {s.requests_per_level} is below --concurrency {top}: that level "
                           f"would never have {top} requests in flight; give at least {top}")


def fitting_chats(chats: list[Chat], tokenizer, window: int, max_tokens: int) -> tuple[list[Chat], list[dict]]:
    """The chats whose prompt and whole reply fit the window (so every request can draw max_tokens), and
    those left out with why; none fitting is one TfqError line."""
    kept, left_out = [], []
    for chat in chats:
        rows = len(tokenizer.chat_ids(list(chat.messages))) + max_tokens
        if rows <= window:
            kept.append(chat)
        else:
            left_out.append({"chat": chat.name, "rows": rows,
                             "why": f"prompt + {max_tokens} reply tokens = {rows} rows, past the window of {window}"})
    if not kept:
        raise TfqError(f"no chat of the suite fits the plan's window of {window} rows with --max-tokens {max_tokens}; "
                       f"raise the plan key window (--set window=N) or lower --max-tokens")
    return kept, left_out


# ---------------------------------------------------------------------------------------- one request

async def send(client, model: str, chats: list[Chat], index: int, max_tokens: int) -> Reply:
    """One streamed chat completion, timed as it arrives. Chunks carry their token ids (a tfq extension the
    client passes in extra_body), so a token whose text is empty (part of a UTF-8 character) still counts."""
    import openai

    reply = Reply(index)
    start = last = time.perf_counter()
    parts = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=list(chats[index].messages), temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            # a connection a request: llama-server (cpp-httplib) closes a kept-alive connection after a few
            # requests, which a client reusing it takes for a failure; both engines are asked the same way
            extra_headers={"Connection": "close"})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                reply.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                content = choice.delta.content or ""
                if content or getattr(choice, "token_ids", None):
                    if reply.ttft_s is None:
                        reply.ttft_s = now - start
                    else:
                        reply.gaps_s.append(now - last)
                    last = now
                    parts.append(content)
                reply.finish = choice.finish_reason or reply.finish
    except openai.APIError as e:
        raise TfqError(f"chat {chats[index].name!r}: the server answered {e}") from None
    reply.text = "".join(parts)
    reply.wall_s = time.perf_counter() - start
    return reply


# ----------------------------------------------------------------------------------------- one level

async def drive(base_url: str, model: str, chats: list[Chat], requests: int, concurrency: int, max_tokens: int,
                done: Callable[[], None], timeout_s: float = TIMEOUT_S) -> Level:
    """`requests` requests, chat i % len(chats) for request i, at most `concurrency` in flight."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=timeout_s) as client:
        # untimed: the first call pays for the connection and lazy set-up on both sides, not the server's speed
        await send(client, model, chats, 0, max_tokens)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> Reply:
            async with gate:
                reply = await send(client, model, chats, i % len(chats), max_tokens)
            done()
            return reply

        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return Level(concurrency, list(replies), wall)


# a level: (chats, requests, concurrency, max_tokens, done) -> Level, on a fresh server of some engine
LevelRun = Callable[[list[Chat], int, int, int, Callable[[], None]], Level]


def tfq_level(target: Target) -> LevelRun:
    return lambda chats, requests, concurrency, max_tokens, done: serve_level(target, chats, requests, concurrency,
                                                                              max_tokens, done)


def serve_level(target: Target, chats: list[Chat], requests: int, concurrency: int, max_tokens: int,
                done: Callable[[], None] = lambda: None) -> Level:
    """A fresh engine behind a fresh server, driven at one concurrency; the server stops after."""
    from tfq.serve.background import ServeOptions, build_served, serving

    # a queue as deep as the level, so requests past the lanes wait for one instead of getting 429
    served = build_served(target.plan, target.layout, target.loaded, target.name,
                          ServeOptions(queue=max(64, concurrency)))
    with serving(served) as base_url:
        return asyncio.run(drive(base_url, target.name, chats, requests, concurrency, max_tokens, done))


# -------------------------------------------------------------------------------------- the whole run

def chats_used(settings: ServeSettings, chats: list[Chat]) -> int:
    """How many of the chats (from the first) some level sends."""
    return min(len(chats), max(settings.requests_at(c) for c in settings.concurrency))


def alone_count(settings: ServeSettings, chats: list[Chat]) -> int:
    """Chats the reference must send alone: those the concurrency-1 level (if any) does not send."""
    covered = min(len(chats), settings.requests_at(1)) if 1 in settings.concurrency else 0
    return chats_used(settings, chats) - covered


def total_requests(settings: ServeSettings, chats: list[Chat]) -> int:
    """The requests run_levels sends, warm-ups left out: every level's and the reference's."""
    return sum(settings.requests_at(c) for c in settings.concurrency) + alone_count(settings, chats)


def run_levels(level: LevelRun, chats: list[Chat], settings: ServeSettings, progress: Listener = Listener(),
               who: str = "") -> tuple[list[Level], dict[int, str]]:
    """Every level in the order given, then the reference: each chat's reply at concurrency 1 (the first the
    concurrency-1 level got for it, else sent alone, one at a time, on a fresh server). level: tfq_level(target)
    or a peer's."""
    levels = []
    for c in settings.concurrency:
        n = settings.requests_at(c)
        progress.level(f"{who}concurrency {c}, {n} requests")
        levels.append(level(chats, n, c, settings.max_tokens, progress.reply))
    reference: dict[int, str] = {}
    for done in levels:
        if done.concurrency == 1:
            for r in done.replies:
                reference.setdefault(r.chat, r.text)
    missing = [i for i in range(chats_used(settings, chats)) if i not in reference]
    if missing:
        progress.level(f"{who}reference: {len(missing)} chats alone")
        alone = level([chats[i] for i in missing], len(missing), 1, settings.max_tokens, progress.reply)
        reference.update({missing[r.chat]: r.text for r in alone.replies})
    return levels, reference


# ------------------------------------------------------------------------------------------ the figures

def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds, by numpy.percentile (its default, linear interpolation between the two
    nearest samples: with few samples p99 lies just under the largest)."""
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values) * 1000, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def level_figures(level: Level, chats: list[Chat], reference: dict[int, str]) -> dict:
    replies = level.replies
    tokens = sum(r.output_tokens for r in replies)
    return {
        "concurrency": level.concurrency,
        "requests": len(replies),
        "wall_s": level.wall_s,
        "requests_per_s": len(replies) / level.wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / level.wall_s,
        "ttft_ms": percentiles_ms([r.ttft_s for r in replies if r.ttft_s is not None]),
        "tbt_ms": percentiles_ms([g for r in replies for g in r.gaps_s]),
        "equal_replies": sum(r.text == reference[r.chat] for r in replies),
        "per_request": [{"chat": chats[r.chat].name, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000,
                         "wall_ms": r.wall_s * 1000, "output_tokens": r.output_tokens, "finish": r.finish,
                         "equal": r.text == reference[r.chat]} for r in replies],
    }


def llama_server_level(gguf, window: int, slots: int, threads: int) -> LevelRun:
    """llama.cpp's server as the peer (tfq/bench/peers/llama_server.py): a fresh process each level; one that ends or
    stops answering raises PeerDown with one line."""
    from tfq.bench.peers.llama_server import PEER_TIMEOUT_S, PeerDown, llama_server

    def level(chats, requests, concurrency, max_tokens, done):
        with llama_server(gguf, window, slots, threads) as (base_url, ended):
            try:
                return asyncio.run(drive(base_url, "peer", chats, requests, concurrency, max_tokens, done,
                                         PEER_TIMEOUT_S))
            except TfqError as e:  # the client's complaint; the process's own end says more, when it ended
                raise PeerDown(ended() or f"llama-server stopped answering: {e}") from None
    return level


def build_serve_report(target: Target, config, settings: ServeSettings, suite: SuiteSent, levels: list[Level],
                       reference: dict[int, str], threads: int, loads: tuple, wall: float) -> dict:
    """Everything the run measured, JSON-ready."""
    import torch

    from tfq.plan import plan_json

    chats = suite.chats
    used = chats_used(settings, chats)
    return {
        "settings": {"model": target.plan.model, "served_name": target.name, "folder": str(target.loaded.folder),
                     "concurrency": list(settings.concurrency),
                     "requests_per_level": {str(c): settings.requests_at(c) for c in settings.concurrency},
                     "max_tokens": settings.max_tokens, "temperature": 0.0, "suite": suite.path,
                     "chats": [c.name for c in chats[:used]], "left_out": suite.left_out},
        "plan": plan_json(target.plan, config, target.layout),
        "machine": {"cpus": os.cpu_count(), "torch_threads": threads,
                    "threads_fixed": settings.threads is not None or bool(os.environ.get("TFQ_THREADS")),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "load_average_before": list(loads[0]), "load_average_after": list(loads[1])},
        "reference": {"from_concurrency_1": used - alone_count(settings, chats),
                      "sent_alone": alone_count(settings, chats)},
        "wall_s": wall,
        "levels": [level_figures(level, chats, reference) for level in levels],
    }
