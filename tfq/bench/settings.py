"""The bench's options, bad input refused before anything loads, and each arm's plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfq.errors import TfqError
from tfq.plan import Plan, derive, pages_for

ARMS = ("whole", "paged", "partial", "drafted")
ARM_ABOUT = {
    "whole": "every stream in a contiguous lane, rows attention, no drafting",
    "paged": "streams beyond the first on pages",
    "partial": "partial attention arithmetic instead of rows",
    "drafted": "n-gram drafts verified in the batch",
}
PEERS = ("hf", "llama.cpp", "llama.cpp-gguf", "ik_llama.cpp", "none")
PAGE_ROWS = 256  # the paged arm's page rows when the plan has none
DRAFT = "ngram:4"  # the drafted arm's drafter when the plan drafts nothing


@dataclass(frozen=True)
class BenchSettings:
    lanes: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 128
    tokens: int = 32
    repeats: int = 3
    peer: str = "hf"
    arms: tuple[str, ...] = ARMS
    seed: int = 0
    threads: int | None = None  # torch threads for both engines; None: torch's default


# ------------------------------------------------------------------------------------------ bad input

def parse_counts(text: str, option: str, singular: str, plural: str, one: str, example: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8), in the order given, repeats dropped; anything else one TfqError line naming
    `option` (`one`: what a count of 1 means, for the message)."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise TfqError(f"{option} {text!r}: give {plural} separated by commas, e.g. {example}") from None
    if not counts:
        raise TfqError(f"{option} {text!r}: give at least one {singular}, e.g. {example}")
    for n in counts:
        if n < 1:
            raise TfqError(f"{option} {n}: a {singular} must be at least 1 ({one}), e.g. {option} {example}")
    return tuple(dict.fromkeys(counts))


def parse_lanes(text: str) -> tuple[int, ...]:
    return parse_counts(text, "--lanes", "lane count", "lane counts", "one stream", "1,2,4,8")


def parse_arms(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise TfqError(f"--arms names no arm; arms are {','.join(ARMS)}")
    for n in names:
        if n not in ARMS:
            raise TfqError(f"unknown arm {n!r}; arms are {','.join(ARMS)}")
    return names


def check_settings(s: BenchSettings) -> None:
    """Bad numbers, refused before anything loads."""
    if s.tokens < 1:
        raise TfqError(f"--tokens must be at least 1, got {s.tokens}")
    if s.prompt_tokens < 1:
        raise TfqError(f"--prompt-tokens must be at least 1, got {s.prompt_tokens}")
    if s.repeats < 1:
        raise TfqError(f"--repeats must be at least 1, got {s.repeats}")
    if s.threads is not None and s.threads < 1:
        raise TfqError(f"--threads must be at least 1, got {s.threads}")
    if s.peer not in PEERS:
        raise TfqError(f"--peer {s.peer!r}: choose hf (HF transformers generate), llama.cpp (on the same weights "
                       f"as an F32 GGUF), llama.cpp-gguf (the GGUF file as shipped), ik_llama.cpp (the fork, on the "
                       f"same file as llama.cpp) or none")


def check_against_plan(s: BenchSettings, plan: Plan) -> None:
    top = max(s.lanes)
    if top > plan.lanes:
        by = plan.source("lanes")
        raise TfqError(f"--lanes {top} is beyond the plan's {plan.lanes} lanes{f' (set by {by})' if by else ''}; "
                       f"raise the plan key lanes (--set lanes={top} or TFQ_LANES={top}) or bench fewer lanes")
    need = s.prompt_tokens + s.tokens
    if need > plan.window:
        raise TfqError(f"--prompt-tokens {s.prompt_tokens} + --tokens {s.tokens} = {need} rows do not fit the plan's "
                       f"window of {plan.window}; raise the plan key window (--set window={need}) or bench less")


# ------------------------------------------------------------------------------------------- the plans

def bench_window(plan: Plan, s: BenchSettings) -> int:
    """Rows each stream needs (prompt + reply), rounded up to whole pages, at most the plan's window: the
    cache is sized to the bench, not to the plan's longest chat (attention reads only a stream's own rows)."""
    pages = plan.kv.pages or PAGE_ROWS
    return min(plan.window, pages_for(s.prompt_tokens + s.tokens, pages) * pages)


def arm_plan(base: Plan, arm: str, lanes: int, window: int) -> Plan:
    """The base plan (its kv dtype, prefill chunk, budget) with this arm's keys; each tagged "bench ARM"."""
    pages = base.kv.pages or PAGE_ROWS
    changes: dict[str, Any] = {"lanes": lanes, "window": window, "attention": "rows", "draft": "none", "kv.pages": 0}
    if arm == "paged":
        changes.update({"kv.pages": pages, "kv.paged": "more", "kv.pool": (lanes - 1) * pages_for(window, pages)})
    elif arm == "partial":
        changes["attention"] = "partial"
    elif arm == "drafted":
        changes["draft"] = base.draft if base.draft != "none" else DRAFT
    return derive(base, changes, f"bench {arm}")


def skipped_arm(arm: str, lanes: int) -> str | None:
    if arm == "paged" and lanes == 1:
        return "at 1 lane the only stream is contiguous (pages are for streams beyond the first): the whole arm"
    return None
