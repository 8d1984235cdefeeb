"""The scheduler: which streams run in the next forward, with which rows, and what the forward changed. It
decides and keeps the books; it computes nothing (the runner does: tfq/engine/runner.py).

`schedule(guesses)` admits waiting streams into free lanes (oldest first) and gives every running stream room
in the cache for its rows (a prompt chunk of at most `prefill_chunk` rows, or the token it drew last plus the
drafter's guesses). `update(step, drawn)` takes what each stream drew and owns everything that changes: rows
cached, guesses kept, pages published and given back, the verifies a hybrid must roll back, finishing.

While some stream decodes, a forward is bounded: the decodes and verifies first, then prompt chunks, oldest
first, in what is left; so a long prompt holds back no stream's next token by more than one such forward. The
bound is `step_tokens` rows, or with `step_steps`, time: the prompt rows that keep the step within that many
decode steps of the running streams, by the cost of steps learned as they run (tfq/engine/step_cost.py); and a
stream scoring its prompt shares the logits rows drawing leaves. One `Budget` holds the three
(tfq/engine/budget.py).

When the page pool runs dry it drops guesses first, then preempts the newest stream holding pages; a preempted
stream goes back to the front of the queue and recomputes its cache when readmitted (its reply is unchanged:
every row is computed the same way). The result is a plain `Step` record, each stream with its `Feed` (its chunk
of its own tokens, then its guesses), which the runner turns into tensors; the scheduler keeps nothing of it
until `update`, which returns `Verified` records for the runner.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tfq.engine.batch import Feed
from tfq.engine.budget import Budget
from tfq.engine.pages import PagePool
from tfq.engine.settings import EngineSettings
from tfq.engine.step_cost import StepCost, Work, chunk_work
from tfq.engine.stream import Finish, Status, Stream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """One stream in a forward, and the rows it feeds (its chunk, then its guesses: `feed.chunk`, `feed.guesses`)."""

    stream: Stream
    feed: Feed


@dataclass
class Step:
    """What one forward holds: its streams and their feeds, oldest stream first. Everything the scheduler decided
    for the forward is here: nothing of it stays on the scheduler between `schedule` and `update`."""

    scheduled: list[Scheduled] = field(default_factory=list)
    failed: list[Stream] = field(default_factory=list)  # streams that cannot fit at all, finished with an error

    @property
    def streams(self) -> list[Stream]:
        return [s.stream for s in self.scheduled]

    @property
    def feeds(self) -> list[Feed]:
        """What the runner takes."""
        return [s.feed for s in self.scheduled]

    @property
    def work(self) -> Work:
        """What its forward computes, in the terms of the cost of steps."""
        return Work.total(chunk_work(s.feed.start, len(s.feed.tokens)) for s in self.scheduled)


@dataclass(frozen=True)
class Stats:
    """The scheduler's counts at one moment (the server's metrics read them)."""

    waiting: int  # streams queued for a lane
    running: int  # lanes holding a stream
    preemptions: int  # streams sent back to the queue, in all
    free_pages: int  # pages of the pool no stream holds (cached idle pages included)
    cached_pages: int  # of those, pages the prefix cache keeps
    reused_rows: int  # prompt rows streams took from the prefix cache, in all
    disk: tuple[int, int, int] = (0, 0, 0)  # the prefix store's pages read back, written and ignored, in all


@dataclass(frozen=True)
class Verified:
    """A verify that kept fewer rows than it fed: a hybrid's state in `slot` must go back to its first `kept`
    rows (tfq.engine.runner.Runner.settle)."""

    stream: Stream
    slot: int
    kept: int  # rows of the verify whose tokens stand
    rows: int  # rows it fed


class Scheduler:
    def __init__(self, settings: EngineSettings, pages: PagePool):
        """settings: lanes (the first `contiguous_lanes` contiguous, the rest paged), window, prefill_chunk, and
        the forward's budget (step_tokens, step_steps, logits_rows: 0 bounds nothing here, the engine resolves
        its auto); pages: the cache's pool."""
        self.settings = settings
        self.lanes: list[Stream | None] = [None] * settings.lanes
        self.pages = pages
        self.cost = StepCost()  # what steps cost here (observe: the engine's clock)
        self.waiting: deque[Stream] = deque()
        self.admitted = 0
        self.preemptions = 0  # streams sent back to the queue, in all (the server's metrics)

    def add(self, st: Stream) -> None:
        """Queue a stream; a prompt that cannot fit the window finishes at once with an error."""
        if len(st.tokens) >= self.settings.window:
            st.fail(f"prompt of {len(st.tokens)} tokens does not fit the window of {self.settings.window} rows; "
                    f"raise window (TFQ_WINDOW) or shorten the prompt")
            st.status = Status.FINISHED
            return
        st.status = Status.WAITING
        self.waiting.append(st)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(st is not None for st in self.lanes)

    def running(self) -> list[Stream]:
        return [st for st in self.lanes if st is not None]

    def stats(self) -> Stats:
        prefix = self.pages.prefix
        store = self.pages.store
        return Stats(len(self.waiting), sum(st is not None for st in self.lanes), self.preemptions,
                     self.pages.unheld, len(prefix.idle) if prefix else 0, prefix.reused_rows if prefix else 0,
                     (store.loaded, store.written, store.ignored) if store else (0, 0, 0))

    def guess_budgets(self, k: int) -> tuple[list[Stream], list[int]]:
        """The decoding streams and how many guesses each may take: at most k, within its token and window
        budgets (a guess past either could never stand)."""
        decoding = [st for st in self.running() if st.pending == 1]
        return decoding, [max(0, min(k, st.request.max_tokens - st.drawn - 1, self.settings.window - len(st.tokens)))
                          for st in decoding]

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self, guesses: dict[int, list[int]] | None = None) -> Step:
        """The next forward. guesses: stream id -> the drafter's guesses (tfq.engine.runner.Runner.propose)."""
        self._admit()
        running = self.running()
        for st in running:
            st.guesses = list(guesses.get(st.id, ())) if guesses and st.pending == 1 else []
            st.proposed += len(st.guesses)
        step = Step()
        for st, n in self._reserve(self._share_rows(running), step):
            done = st.cached + n == len(st.tokens)
            logits = (1 + len(st.guesses)) if done else 0
            if st.request.prompt_logprobs is not None and st.cached < len(st.request.prompt):
                logits = n + len(st.guesses)  # every row of a prompt chunk: each scores the prompt's next token
            step.scheduled.append(Scheduled(st, Feed(st.placement, st.cached, st.tokens[st.cached:st.cached + n]
                                                     + st.guesses, logits, guesses=len(st.guesses))))
        return step

    def _admit(self) -> None:
        for i in range(len(self.lanes)):
            if self.lanes[i] is None and self.waiting:
                st = self._next(paged=i >= self.settings.contiguous_lanes)
                if st is None:
                    continue
                st.lane, st.status = i, Status.RUNNING
                if st.order is None:
                    st.order = self.admitted
                    self.admitted += 1
                st.placement = self.pages.lane(i) if i < self.settings.contiguous_lanes \
                    else self.pages.paged(i, st.request.cache_salt)
                if not st.wants_prompt_scores:  # cached pages of its prefix, if any
                    st.cached = self.pages.adopt(st.placement, st.tokens)
                st.reused += st.cached
                self.lanes[i] = st
                log.debug("stream %d admitted to lane %d (%s): %d tokens, %d rows from the prefix cache", st.id, i,
                          "paged" if st.placement.paged else "contiguous", len(st.tokens), st.cached)

    def _next(self, paged: bool) -> Stream | None:
        """The oldest waiting stream, passing over those a running stream is about to compute the pages for."""
        for st in self.waiting:
            if not (paged and not st.wants_prompt_scores and self._sibling_prefilling(st)):
                self.waiting.remove(st)
                return st
        return None

    def _sibling_prefilling(self, st: Stream) -> bool:
        """With a prefix cache, a stream whose prompt shares full pages with one being prefilled right now (the n
        choices of one request, chats with one system prompt) waits for it: a step later it maps those pages."""
        rows = self.pages.page_rows
        if self.pages.prefix is None:
            return False
        for other in self.running():
            if not other.placement.paged or other.cached >= len(other.request.prompt):
                continue
            shared = next((k for k, (a, b) in enumerate(zip(st.tokens, other.tokens)) if a != b),
                          min(len(st.tokens), len(other.tokens)))
            if min(shared, len(st.tokens) - 1) // rows > len(other.placement.keys):  # pages it will name soon
                return True
        return False

    def _share_rows(self, running: list[Stream]) -> list[tuple[Stream, int]]:
        """The streams that feed this step, oldest first, each with the rows of its own tokens it feeds: a prompt
        chunk of at most `prefill_chunk` rows, or its last drawn token, within the forward's budget
        (tfq/engine/budget.py); a stream the budget leaves no row sits the step out. Chunking changes no bits
        (the rule)."""
        s = self.settings
        budget = Budget.of(running, self.cost, s.step_tokens, s.step_steps, s.logits_rows)
        oldest_first = sorted(running, key=lambda st: st.order)
        chunks = [(st, budget.take(st, min(st.pending, s.prefill_chunk, self._to_boundary(st))))
                  for st in oldest_first]
        return [(st, n) for st, n in chunks if n]

    def _to_boundary(self, st: Stream) -> int:
        """Rows to the next page boundary of a paged hybrid stream whose states the prefix cache keeps there (a
        chunk ends at it, so the state after it can be kept); no bound otherwise."""
        end = self.pages.boundary(st.cached) if st.placement.paged else None
        return st.pending if end is None else end - st.cached

    def expected_seconds(self, step: Step) -> float | None:
        """What the step should take by the cost learned so far (None until it is learned)."""
        return self.cost.seconds(step.work) if self.cost.ready else None

    def _reserve(self, feeding: list[tuple[Stream, int]], step: Step) -> list[tuple[Stream, int]]:
        """Room for each feeding stream's rows (its chunk, then its guesses), oldest first; when the pool is dry,
        preempt the newest stream holding pages, whether it feeds this step or not (the step budget may leave a
        prompt out of it)."""
        ready: list[tuple[Stream, int]] = []
        for st, n in feeding:
            if st.status is not Status.RUNNING:
                continue  # preempted by an older stream in this very loop
            while not self.pages.grow(st.placement, st.cached + n + len(st.guesses)):
                if st.guesses:  # first give up guessing, then preempt
                    st.guesses = []
                    continue
                holding = [s for s in self.running() if s is not st and s.placement.pages]
                newer = [s for s in holding if s.order > st.order]
                if newer:
                    self.preempt(max(newer, key=lambda s: s.order))
                    continue
                if not holding:
                    st.fail(f"the page pool ({self.pages.pool_pages} pages of {self.pages.page_rows} rows) cannot "
                            f"hold this stream's {st.cached + n + len(st.guesses)} rows; raise kv.pool (TFQ_KV_POOL) "
                            f"or the budget")
                    self.finish(st)
                    step.failed.append(st)
                else:  # older streams hold the pages: wait for them
                    self.preempt(st)
                break
            else:
                ready.append((st, n))
        return ready

    def update(self, step: Step, drawn: list[int], seconds: float | None = None) -> list[Verified]:
        """What the step's forward changed. drawn[i]: tokens step.scheduled[i]'s stream drew (appended to its
        tokens, its finish set, by the engine); a stream that failed drawing is finished. Its rows before the last
        drawn token are cached; of its guesses, those its draws confirmed; a verify's rejected rows give their
        pages back; every full page is published for later streams. seconds: the step's time, which the cost of
        steps learns from. Returns the verifies a hybrid rolls back."""
        if seconds is not None:
            self.cost.observe(step.work, seconds)
        verified = []
        for scheduled, n in zip(step.scheduled, drawn):
            st, feed = scheduled.stream, scheduled.feed
            if st.finish is Finish.ERROR:
                continue
            # a chunk short of the prompt's end draws none
            st.cached = feed.start + (feed.chunk if not n else feed.chunk - 1 + n)
            if feed.guesses:
                st.accepted += n - 1  # every draw but the last confirmed a guess
                st.verifies += 1
                self.pages.shrink(st.placement, st.cached)
                kept = st.cached - feed.start
                if kept < len(feed.tokens) and st.finish is None:
                    verified.append(Verified(st, st.placement.slot, kept, len(feed.tokens)))
            st.guesses = []
            # its full pages, for later streams; a hybrid's state too where a forward without guesses ended a page
            self.pages.publish(st.placement, st.tokens, st.cached, state_now=not feed.guesses)
        for st in self.running():
            if st.finish is not None:
                self.finish(st)
        return verified

    # -- leaving ------------------------------------------------------------------------------------------
    def preempt(self, st: Stream) -> None:
        """Free a stream's lane and pages and requeue it first; it recomputes its cache when readmitted."""
        log.info("stream %d preempted for lack of pages, %d cached rows to recompute", st.id, st.cached)
        self._vacate(st)
        st.preempted += 1
        self.preemptions += 1
        st.recomputed += st.cached > 0  # sent back with cached work, which it computes again
        st.cached, st.guesses, st.status = 0, [], Status.WAITING
        self.waiting.appendleft(st)

    def finish(self, st: Stream) -> None:
        """The stream is done (or failed, or aborted): it gives back everything it holds."""
        if st.status is Status.WAITING and st in self.waiting:
            self.waiting.remove(st)
        self._vacate(st)
        st.status = Status.FINISHED
        level = logging.WARNING if st.finish is Finish.ERROR else logging.INFO
        log.log(level, "stream %d finished (%s): %d tokens drawn, preempted %d times%s", st.id, st.finish,
                st.drawn, st.preempted, f": {st.error}" if st.error else "")

    def _vacate(self, st: Stream) -> None:
        if st.placement is not None:
            self.pages.release(st.placement)
        if st.lane is not None:
            self.lanes[st.lane] = None
        st.lane, st.placement = None, None
