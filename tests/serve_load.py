"""The server under load, with the real `openai` client: calls fired at random times, then each call alone on a
fresh server, compared choice by choice in token ids, log-probabilities and logits digests."""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from tiny import CORPUS

EXTRA = {"return_token_ids": True, "return_digests": True}


@dataclass(frozen=True)
class Call:
    name: str
    chat: bool  # chat completions, else completions
    stream: bool
    delay: float  # seconds after the start of the load
    body: dict  # what goes to create(), but model and stream


def corpus_text(rng: random.Random, chars: int, start: int | None = None) -> str:
    if start is None:
        start = rng.randrange(len(CORPUS) - chars) if chars < len(CORPUS) else 0
    return (CORPUS * (1 + chars // len(CORPUS)))[start:start + chars]


def calls(seed: int = 0, count: int = 32, long_chars: int = 900, max_tokens: int = 40,
          shared: bool = False, echo: bool = False) -> list[Call]:
    """Greedy and seeded sampled, mixed prompt and reply lengths, every fifth with n = 2, every third streamed;
    the first three are long prompts fired at once (the first two greedy), so at least one of them runs on pages
    (the control needs it), and two do: in the tests' small pool they cannot both hold their rows, so a stream
    is preempted whatever the machine's speed.
    `shared`: every long prompt starts at the same place, so they share their first pages (the prefix cache).
    `echo`: completions not streamed echo their prompts with scores (compared like the reply's)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        long = i < 3 or rng.random() < 0.15
        text = corpus_text(rng, long_chars if long else rng.randrange(20, 200), 0 if long and shared else None)
        sampled = i >= 2 and rng.random() < 0.5
        body = {"max_tokens": rng.randrange(4, max_tokens), "n": 2 if i % 5 == 4 else 1,
                "temperature": 0.8 if sampled else 0.0, "top_p": 0.9 if sampled else 1.0, "seed": rng.randrange(1000),
                "extra_body": EXTRA}
        chat = i % 2 == 0
        if chat:
            body.update(messages=[{"role": "user", "content": text}], logprobs=True, top_logprobs=2)
        else:
            body.update(prompt=text, logprobs=2, echo=echo and i % 3 != 2)
        out.append(Call(f"c{i:02d}", chat, i % 3 == 2, 0.0 if i < 3 else rng.uniform(0, 2.0), body))
    return out


def _choice_record(chat: bool, choice: dict) -> dict:
    lp = choice.get("logprobs") or {}
    if chat:
        scores = [(c["logprob"], tuple(t["logprob"] for t in c["top_logprobs"])) for c in lp.get("content") or []]
    else:
        scores = list(zip(lp.get("token_logprobs") or [],
                          [tuple((d or {}).values()) for d in lp.get("top_logprobs") or []]))
    return {"ids": list(choice["token_ids"]), "logprobs": scores, "digests": list(choice["digests"]),
            "finish": choice["finish_reason"], "receipt": choice.get("receipt")}


async def send(client, model: str, call: Call, after_chunk=None) -> list[dict]:
    """One call's choices, each as {ids, logprobs, digests, finish, receipt}. after_chunk(k), when given, is awaited
    after the k-th chunk of a stream (a test's moment to act mid-reply)."""
    create = client.chat.completions.create if call.chat else client.completions.create
    if not call.stream:
        r = (await create(model=model, **call.body)).model_dump()
        return [_choice_record(call.chat, c) for c in sorted(r["choices"], key=lambda c: c["index"])]
    n = call.body.get("n", 1)
    got = [{"ids": [], "logprobs": [], "digests": [], "finish": None} for _ in range(n)]
    k = 0
    async for chunk in await create(model=model, stream=True, **call.body):
        k += 1
        if after_chunk is not None:
            await after_chunk(k)
        for c in chunk.model_dump()["choices"]:
            rec = got[c["index"]]
            part = _choice_record(call.chat, {**c, "token_ids": c.get("token_ids") or [],
                                              "digests": c.get("digests") or []})
            rec["ids"] += part["ids"]
            rec["logprobs"] += part["logprobs"]
            rec["digests"] += part["digests"]
            rec["finish"] = c["finish_reason"] or rec["finish"]
            rec["receipt"] = c.get("receipt") or rec.get("receipt")  # the last chunk of a choice, when asked
    return got


async def fire(base_url: str, model: str, load: list[Call]) -> list[list[dict]]:
    """Every call at its time, all in flight together; replies in the calls' order."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=900) as client:
        async def one(call: Call):
            await asyncio.sleep(call.delay)
            return await send(client, model, call)

        return list(await asyncio.gather(*(one(c) for c in load)))


def differences(under_load: list[list[dict]], alone: list[list[dict]], load: list[Call]) -> list[str]:
    """The calls whose choices differ from their run alone, and in what."""
    out = []
    for call, got, want in zip(load, under_load, alone):
        for i, (g, w) in enumerate(zip(got, want)):
            what = [k for k in ("ids", "logprobs", "digests", "finish") if g[k] != w[k]]
            if what:
                out.append(f"{call.name} choice {i}: {', '.join(what)}")
        if len(got) != len(want):
            out.append(f"{call.name}: {len(got)} choices, alone {len(want)}")
    return out


def tally(under_load: list[list[dict]], alone: list[list[dict]]) -> dict[str, int]:
    """Choices in all, and how many equal their run alone in each respect."""
    pairs = [(g, w) for got, want in zip(under_load, alone) for g, w in zip(got, want)]
    return {"choices": len(pairs), **{k: sum(g[k] == w[k] for g, w in pairs) for k in ("ids", "logprobs", "digests")},
            "tokens": sum(len(g["ids"]) for g, _ in pairs)}
