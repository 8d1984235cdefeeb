"""Recorded bits: what the shipped suite gives on a model, written once, and checked on any machine.

A record holds, for each weights kind and each chat, the reply's token ids, the digest of every logits row and
the log-probabilities (the drawn token's and the top TOP, each float64 written exactly, in hex), plus the
prompt tokens' scores of one chat. `tfq verify` runs the same requests here and compares chat by chat: equal,
or the first reply position where ids, logits or log-probabilities part. The repository carries the record of
the default model (tfq/reference/default.json); docs/contract.md says which CPUs it covers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tfq.decode.sampling import TokenLogprob
from tfq.engine.stream import Request, Result

REFERENCE = Path(__file__).resolve().parent.parent / "reference" / "default.json"
TOKENS = 32  # reply tokens a chat
TOP = 3  # top log-probabilities each token
WEIGHTS = ("gguf-q8", "gguf", "fp32")  # the default model's arithmetics: the default (its blocks, activations in 8
# bits), its blocks with fp32 sums, and their fp32 values
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}  # a second sampled chat: the suite's first, drawn
FORMAT = 2  # 1: each digest a sha256 (to 2026-12-05); 2: XXH3 (tfq/decode/sampling.py: digest)


@dataclass(frozen=True)
class ChatBits:
    """What one chat gave: the record's unit."""

    chat: str
    ids: list[int]
    digests: list[str]
    logprobs: list[list]  # per reply token: [token, logprob hex, [[id, logprob hex], ...]]
    prompt_scores: list | None = None  # per prompt token after the first: [token, logprob hex]

    @classmethod
    def of(cls, request: Request, result: Result) -> "ChatBits":
        if result.error:
            raise RuntimeError(f"chat {request.label} failed: {result.error}")
        scores = None
        if result.prompt_logprobs is not None:
            scores = [_exact(s)[:2] for s in result.prompt_logprobs[1:]]
        return cls(request.label, list(result.ids), list(result.digests), [_exact(s) for s in result.logprobs],
                   scores)


def _exact(s: TokenLogprob) -> list:
    return [s.token, float(s.logprob).hex(), [[t, float(v).hex()] for t, v in s.top]]


@dataclass(frozen=True)
class Parting:
    """Where a chat parts from its record (None fields: equal), or that it is missing on one side."""

    chat: str
    ids: int | None = None  # first reply position whose token differs (or the shorter length)
    logits: int | None = None
    logprobs: int | None = None
    prompt_scores: int | None = None
    missing: bool = False

    @property
    def equal(self) -> bool:
        return not self.missing and self.ids is self.logits is self.logprobs is self.prompt_scores is None


def first_difference(a: list | None, b: list | None) -> int | None:
    """The first index where two lists differ, the shorter one's length if one is a prefix; None when equal."""
    a, b = a or [], b or []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(want: ChatBits | None, got: ChatBits | None, chat: str) -> Parting:
    if want is None or got is None:
        return Parting(chat, missing=True)
    return Parting(chat, first_difference(want.ids, got.ids), first_difference(want.digests, got.digests),
                   first_difference(want.logprobs, got.logprobs),
                   first_difference(want.prompt_scores, got.prompt_scores))


def requests(chats, tokenizer) -> list[Request]:
    """The recorded requests: every chat of the suite for TOKENS tokens (its own settings kept: the suite has a
    sampled chat), the first chat again drawn with SAMPLED, and the first chat's prompt scored."""
    from tfq.suite import requests_for

    base = requests_for(chats, tokenizer, TOKENS, 0.0, 1.0, 0)
    out = [dataclasses.replace(r, max_tokens=min(r.max_tokens, TOKENS), logprobs=TOP) for r in base]
    out[0] = dataclasses.replace(out[0], prompt_logprobs=1)
    out.append(dataclasses.replace(out[0], label=f"{out[0].label}, sampled", prompt_logprobs=None, **SAMPLED))
    return out


def streams(chats) -> int:
    """How many requests `requests` makes of `chats`: every chat, and the first again sampled."""
    return len(chats) + 1


def run(plan, layout, loaded, reqs: list[Request], on_token: Callable | None = None) -> list[ChatBits]:
    """The requests through one engine of the plan, as a user's run would go."""
    from tfq.engine.core import Engine

    engine = Engine.from_plan(plan, layout, loaded)
    return [ChatBits.of(r, res) for r, res in zip(reqs, engine.generate(reqs, on_token))]


def suite_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def document(model: str, suite: Path, runs: dict[str, list[ChatBits]], facts: dict) -> dict:
    return {"format": FORMAT, "model": model, "suite_sha256": suite_sha(suite), "tokens": TOKENS, "top": TOP,
            "sampled": SAMPLED, "recorded_on": facts,
            "weights": {w: [dataclasses.asdict(c) for c in chats] for w, chats in runs.items()}}


def read(path: Path) -> dict:
    """A record written by `document` (a clear error for anything else)."""
    from tfq.errors import TfqError

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TfqError(f"{path}: cannot read a record of bits ({e}); write one with tfq verify --record FILE")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("weights"), dict):
        raise TfqError(f"{path} is not a record of bits (format {FORMAT}); write one with tfq verify --record FILE")
    return doc


def recorded(doc: dict, weights: str) -> dict[str, ChatBits]:
    return {c["chat"]: ChatBits(**c) for c in doc["weights"].get(weights, [])}


def compare_run(doc: dict, weights: str, got: list[ChatBits]) -> list[Parting]:
    """Every chat of the record and of the run, compared (a chat on one side only is `missing`)."""
    want = recorded(doc, weights)
    mine = {c.chat: c for c in got}
    names = list(want) + [n for n in mine if n not in want]
    return [compare(want.get(n), mine.get(n), n) for n in names]
