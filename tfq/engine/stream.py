"""Requests, their results, and the state of a stream while the engine runs it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum

import torch

from tfq.decode.grammar import Constraint
from tfq.decode.penalties import Penalties
from tfq.decode.sampling import TokenLogprob, choice_seed
from tfq.engine.pages import Placement
from tfq.errors import TfqError

MOST_TOP_LOGPROBS = 20  # as OpenAI's API


class Status(Enum):
    WAITING = "waiting"  # queued (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds a lane, and pages if it is paged
    FINISHED = "finished"  # done (eos, length, stop, window), failed or aborted: holds nothing


class Finish(StrEnum):
    """Why a stream ended (a string too: results and JSON carry the word)."""

    EOS = "eos"  # it drew an end-of-sequence token
    STOP = "stop"  # its text reached a stop string
    LENGTH = "length"  # it drew max_tokens tokens
    WINDOW = "window"  # its tokens filled the window
    ERROR = "error"  # it failed: Result.fault says whose the error is
    ABORT = "abort"  # it was ended from outside (a client gone, an interrupted run)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, chat template already applied
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    label: str = ""
    logprobs: int | None = None  # None: none; k >= 0: each drawn token's log-probability and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (the head runs on
    # every prompt row then: evaluation's log-likelihood)
    penalties: Penalties = Penalties()  # on the row before the draw (tfq/decode/penalties.py)
    constraint: Constraint | None = None  # a grammar the reply follows (tfq/decode/grammar.py)
    cache_salt: str = ""  # streams share prefix-cache pages only with streams of the same salt (a server's tenant)
    resumed: tuple[int, ...] = ()  # reply tokens drawn before (by a replica that died): the stream goes on after them
    # as a stream preempted there would (its draws keyed by position, penalties and grammar by its reply)

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
        for key in ("logprobs", "prompt_logprobs"):
            k = getattr(self, key)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MOST_TOP_LOGPROBS):
                raise TfqError(f"{name}: {key} must be an integer from 0 to {MOST_TOP_LOGPROBS}, got {k!r}")
        self.penalties.validate(name)
        if len(self.resumed) >= self.max_tokens:
            raise TfqError(f"{name}: {len(self.resumed)} resumed tokens leave none of max_tokens {self.max_tokens} "
                           f"to draw; resume a reply that has not ended")
        if self.resumed and (self.prompt_logprobs is not None):
            raise TfqError(f"{name}: a resumed reply cannot score its prompt again; leave prompt_logprobs out")


def choices(prompts: list[list[int]], n: int, seed: int, **settings) -> list[Request]:
    """n requests per prompt, prompt-major (as OpenAI numbers choices); choice j draws with
    `choice_seed(seed, j)`, so choice 0 is the request with n = 1."""
    return [Request(prompt=tuple(p), seed=choice_seed(seed, j), **settings) for p in prompts for j in range(n)]


@dataclass
class Result:
    label: str
    ids: list[int]  # reply token ids (an EOS that ended it included)
    text: str  # reply text (stop string and EOS excluded)
    digests: list[str]  # per reply step: hash of the fp32 logits that chose the token
    finish: Finish
    error: str | None = None
    fault: bool = False  # the error is tfq's (a fault while computing), not the request's (it cannot fit)
    prompt_tokens: int = 0
    first_token_s: float = 0.0
    total_s: float = 0.0
    preempted: int = 0  # times sent back to the queue for lack of pages
    recomputed: int = 0  # of those, times it had cached work to compute again
    reused: int = 0  # rows taken from the prefix cache instead of computed (every admission counted)
    proposed: int = 0  # drafted tokens offered for verification
    accepted: int = 0  # of those, tokens the target drew too
    verifies: int = 0  # forwards that verified guesses
    logits: list[torch.Tensor] | None = None  # per step, when the engine keeps them
    logprobs: list[TokenLogprob] | None = None  # per reply token, when the request asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first)


def shown_after_resumed(request: Request, decoder, eos_ids: frozenset[int], window: int) -> str:
    """The text a client of `request`'s stream had been shown once its `resumed` tokens were drawn: the stream that
    resumes it appends them the same way (tfq/engine/core.py), and a server primes its stream's state with it."""
    st = Stream(-1, request, list(request.prompt), decoder=decoder)
    for token in request.resumed:
        st.append(token, eos_ids, window)
    return st.text[:st.shown]


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that begin some stop string (and so may not be shown yet). Only the
    places where a stop's first character stands are tried, longest first: linear in the stop's length for
    ordinary text, and bounded by its square (the server caps a stop's length) for text made to match."""
    most = 0
    for s in stops:
        tail = text[max(0, len(text) - len(s) + 1):] if len(s) > 1 else ""
        i = tail.find(s[0]) if tail else -1
        while i >= 0 and len(tail) - i > most:
            if s.startswith(tail[i:]):
                most = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return most


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The stop string that begins earliest in `text` at or after `start` (on a tie, the first listed), and
    where it begins; None when none does."""
    found = [(i, k) for k, s in enumerate(stops) if (i := text.find(s, start)) >= 0]
    if not found:
        return None
    i, k = min(found)
    return i, stops[k]


@dataclass
class Stream:
    id: int  # the engine's number for it (Engine.add returns it; Output.id names it)
    request: Request
    tokens: list[int]  # prompt, then every token drawn so far
    status: Status = Status.WAITING
    order: int | None = None  # first admission's order: the newest is preempted first (kept when readmitted,
    # so a preempted stream is not the first victim again)
    lane: int | None = None
    placement: Placement | None = None
    cached: int = 0  # positions whose keys and values are in the cache
    drawn: int = 0  # tokens drawn so far (its reply's length): max_tokens bounds it
    digests: list[str] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    decoder: object | None = None  # tfq.model.tokenizer.StreamDecoder: text as whole characters
    grammar: object | None = None  # tfq.decode.grammar.Matcher, when the request has a constraint
    text: str = ""
    shown: int = 0  # characters of text returned by append so far
    finish: Finish | None = None
    error: str | None = None
    fault: bool = False
    added_s: float = field(default_factory=time.perf_counter)
    first_token_s: float = 0.0
    preempted: int = 0
    recomputed: int = 0
    reused: int = 0
    guesses: list[int] = field(default_factory=list)  # this step's guesses (a drafter's), verified in its forward
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by the token's position

    @property
    def reply(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]

    @property
    def scoring(self) -> bool:
        """Whether it still feeds prompt rows whose logits score the prompt (every such row is a logits row)."""
        return self.request.prompt_logprobs is not None and self.cached < len(self.request.prompt)

    @property
    def wants_prompt_scores(self) -> bool:
        """Whether some prompt token still lacks its score: such a stream computes every prompt row, since a
        row mapped from the prefix cache brings its key and value, not the logits that score the next token."""
        return self.request.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.request.prompt) - 1

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt at first, then the last drawn token)."""
        return len(self.tokens) - self.cached

    def append(self, token: int, eos_ids: frozenset[int], window: int) -> str:
        """Take a drawn token: the text it completes, and whether the stream ends (EOS, a stop string, its
        token budget or the window). Returns the text that became visible."""
        req = self.request
        self.tokens.append(token)
        self.drawn += 1
        if self.drawn == 1:
            self.first_token_s = time.perf_counter() - self.added_s
        if token in eos_ids:
            self.finish = Finish.EOS
        elif self.decoder is not None:
            before = len(self.text)
            self.text += self.decoder.feed(token)
            # a stop can only end in the new text: look from where the longest could begin
            longest = max(map(len, req.stop), default=0)
            hit = first_stop(self.text, req.stop, max(0, before - longest + 1)) if req.stop else None
            if hit is not None:
                self.text = self.text[:hit[0]]
                self.finish = Finish.STOP
        if self.finish is None and self.drawn >= req.max_tokens:
            self.finish = Finish.LENGTH
        elif self.finish is None and len(self.tokens) >= window:
            self.finish = Finish.WINDOW
        if self.finish not in (None, Finish.STOP) and self.decoder is not None:
            self.text += self.decoder.flush()  # a character cut at the very end still shows
        # text that may be the start of a stop string is held back until the next token settles it
        visible = len(self.text) if self.finish is not None else len(self.text) - held_back(self.text, req.stop)
        piece = self.text[self.shown:visible]
        self.shown = max(self.shown, visible)
        return piece

    def fail(self, message: str, fault: bool = False) -> None:
        self.finish, self.error, self.fault = Finish.ERROR, message, fault

    def result(self, keep_logits: bool, total_s: float | None = None) -> Result:
        return Result(label=self.request.label, ids=self.reply, text=self.text, digests=self.digests,
                      finish=self.finish or Finish.ERROR, error=self.error, fault=self.fault,
                      prompt_tokens=len(self.request.prompt),
                      first_token_s=self.first_token_s,
                      total_s=time.perf_counter() - self.added_s if total_s is None else total_s,
                      preempted=self.preempted, recomputed=self.recomputed, reused=self.reused,
                      proposed=self.proposed,
                      accepted=self.accepted, verifies=self.verifies, logits=self.logits if keep_logits else None,
                      logprobs=self.logprobs if self.request.logprobs is not None else None,
                      prompt_logprobs=None if self.request.prompt_logprobs is None else
                      [self.prompt_logprobs.get(i) for i in range(len(self.request.prompt))])
