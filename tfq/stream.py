"""Requests, their results, and the state of a stream while the engine runs it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tfq.cache import Placement
from tfq.errors import TfqError


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, chat template already applied
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    label: str = ""

    def validate(self) -> None:
        """Bad settings are refused before anything runs."""
        name = self.label or "request"
        if not self.prompt:
            raise TfqError(f"{name}: empty prompt; give at least one token")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise TfqError(f"{name}: max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise TfqError(f"{name}: temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise TfqError(f"{name}: top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class Result:
    label: str
    ids: list[int]  # reply token ids (an EOS that ended it included)
    text: str  # reply text (stop string and EOS excluded)
    digests: list[str]  # per reply step: hash of the fp32 logits that chose the token
    finish: str  # eos | length | stop | window | error
    error: str | None = None
    prompt_tokens: int = 0
    first_token_s: float = 0.0
    total_s: float = 0.0
    preempted: int = 0  # times sent back to the queue for lack of pages
    recomputed: int = 0  # of those, times it had cached work to compute again
    proposed: int = 0  # drafted tokens offered for verification
    accepted: int = 0  # of those, tokens the target drew too
    verifies: int = 0  # forwards that verified guesses
    logits: list[torch.Tensor] | None = None  # per step, when the engine keeps them


@dataclass
class Stream:
    index: int
    request: Request
    tokens: list[int]  # prompt, then every token drawn so far
    order: int = 0  # admission order: the newest is preempted first
    lane: int | None = None
    placement: Placement | None = None
    cached: int = 0  # positions whose keys and values are in the cache
    digests: list[str] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    decoder: object | None = None  # tfq.model.tokenizer.StreamDecoder: text as whole characters
    text: str = ""
    finish: str | None = None
    error: str | None = None
    first_token_s: float = 0.0
    preempted: int = 0
    recomputed: int = 0
    drafts: list[int] = field(default_factory=list)  # this step's guesses, verified in the same forward
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0

    @property
    def reply(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt at first, then the last drawn token)."""
        return len(self.tokens) - self.cached
