"""The engine: continuous batching of streams over lanes and pages, one forward per step.

Each step admits waiting streams into free lanes, gives every running stream its rows (a prompt chunk of at
most `prefill_chunk` rows, or the one token it drew last), runs them all in one forward, and draws the next
token of every stream whose rows reached its end. The batch's shape never chooses the arithmetic: only the
plan does (and the `TFQ_PAGED_PARTIAL` control, which reproduces the field report's fault on purpose).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tfq.batch import Feed, forward
from tfq.cache import KVCache
from tfq.proofs.startup import prove
from tfq.model.qwen import Qwen
from tfq.sampling import digest, sample
from tfq.stream import Request, Result, Stream

OnToken = Callable[[int, int, str], None]  # (request index, token id, newly completed text)


@dataclass(frozen=True)
class EngineSettings:
    """What the engine takes from a plan (tfq.plan.Plan + its Layout)."""

    window: int
    lanes: int
    prefill_chunk: int = 512
    kv_dtype: str = "fp32"
    page_rows: int = 0
    paged_all: bool = False
    pool_pages: int = 0
    partial: bool = False
    paged_partial: bool = False

    @property
    def contiguous_lanes(self) -> int:
        if self.page_rows == 0:
            return self.lanes
        return 0 if self.paged_all else 1

    @classmethod
    def from_plan(cls, plan, layout) -> "EngineSettings":
        return cls(window=plan.window, lanes=plan.lanes, prefill_chunk=plan.prefill_chunk, kv_dtype=plan.kv.dtype,
                   page_rows=plan.kv.pages, paged_all=plan.kv.paged == "all", pool_pages=layout.pool_pages,
                   partial=plan.attention == "partial", paged_partial=plan.paged_partial)


class Engine:
    def __init__(self, model: Qwen, settings: EngineSettings, tokenizer=None, eos_ids: Sequence[int] = (),
                 page_order_seed: int | None = None, keep_logits: bool = False, drafter=None, threads=None):
        self.model = model
        self.settings = settings
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids or (tokenizer.eos_ids if tokenizer is not None else ()))
        self.keep_logits = keep_logits
        self.drafter = drafter  # tfq.draft.Drafter or None
        self.threads = threads  # tfq.threads.Threads (the CPU thread count follows the load) or None
        s = settings
        self.cache = KVCache(model.config, lanes=s.contiguous_lanes, window=s.window, page_rows=s.page_rows,
                             pool_pages=s.pool_pages, dtype=s.kv_dtype, page_order_seed=page_order_seed,
                             backend=model.backend)
        self.forwards = 0
        self.proof = None  # tfq.proofs.startup.LayerProof: the model's layer proved row-invariant under these settings
        if not model.backend.interpreted:  # under Triton's interpreter the tests prove the same, faster
            self.proof = prove(model, s.kv_dtype, s.partial, torch.get_num_threads(), self.largest_forward,
                               s.prefill_chunk)

    @property
    def largest_forward(self) -> int:
        """Most rows one forward can hold: a prompt chunk, or a drafted verify, in every lane."""
        guesses = self.drafter.k if self.drafter is not None else 0
        return self.settings.lanes * max(self.settings.prefill_chunk, 1 + guesses)

    def _proved(self, threads: int) -> bool:
        """Whether the thread policy may switch to `threads` (proved once, on first wish)."""
        return self.proof is None or self.proof.holds(threads, self.largest_forward,
                                                      self.settings.prefill_chunk) is None

    @classmethod
    def from_plan(cls, plan, layout, loaded, **kw) -> "Engine":
        """plan: tfq.plan.Plan, layout: its Layout, loaded: tfq.model.load.LoadedModel."""
        from tfq.draft import make_drafter
        from tfq.threads import Threads

        settings = EngineSettings.from_plan(plan, layout)
        if "drafter" not in kw:
            kw["drafter"] = make_drafter(plan.draft, loaded, settings.lanes, settings.window)
        if "threads" not in kw:
            kw["threads"] = Threads.auto() if loaded.model.backend.name == "torch" else None
        return cls(loaded.model, settings, loaded.tokenizer, **kw)

    # -- public -------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], on_token: OnToken | None = None) -> list[Result]:
        for r in requests:
            r.validate()
        streams = [Stream(i, r, list(r.prompt), decoder=self.tokenizer.stream() if self.tokenizer else None)
                   for i, r in enumerate(requests)]
        start = time.perf_counter()
        waiting: deque[Stream] = deque()
        for st in streams:
            if len(st.tokens) >= self.settings.window:
                self._fail(st, f"prompt of {len(st.tokens)} tokens does not fit the window of "
                               f"{self.settings.window} rows; raise window (TFQ_WINDOW) or shorten the prompt")
            else:
                waiting.append(st)
        lanes: list[Stream | None] = [None] * self.settings.lanes
        admitted = 0
        try:
            while waiting or any(lanes):
                for i in range(len(lanes)):
                    if lanes[i] is None and waiting:
                        st = waiting.popleft()
                        st.lane, st.order, admitted = i, admitted, admitted + 1
                        st.placement = self.cache.lane(i) if i < self.settings.contiguous_lanes else self.cache.paged()
                        lanes[i] = st
                running = [st for st in lanes if st is not None]
                self._propose(running)
                running = self._reserve(running, lanes, waiting)
                if running:
                    if self.threads is not None:
                        self.threads.step(self._proved)
                    self._step(running, start, on_token)
                for i, st in enumerate(lanes):
                    if st is not None and st.finish is not None:
                        self._leave(st, lanes)
        finally:
            for st in lanes:  # an interrupted run gives every page back
                if st is not None:
                    self._leave(st, lanes)
            if self.threads is not None:
                self.threads.restore()
        total = time.perf_counter() - start
        return [self._result(st, total) for st in streams]

    # -- one step -----------------------------------------------------------------------------------------
    def _reserve(self, running: list[Stream], lanes, waiting: deque) -> list[Stream]:
        """Give each stream room for this step's rows, oldest first; when the pool is dry, preempt the newest."""
        ready: list[Stream] = []
        for st in sorted(running, key=lambda s: s.order):
            if st.finish is not None or st.placement is None:
                continue
            while not self.cache.grow(st.placement, st.cached + self._rows(st)):
                if st.drafts:  # first give up guessing, then preempt
                    st.drafts = []
                    continue
                newer = [s for s in running if s.order > st.order and s.placement is not None and s.placement.pages]
                if newer:
                    self._preempt(max(newer, key=lambda s: s.order), lanes, waiting)
                    continue
                if not any(s.placement is not None and s.placement.pages for s in running if s is not st):
                    self._fail(st, f"the page pool ({self.cache.pool_pages} pages of {self.cache.page_rows} rows) "
                                   f"cannot hold this stream's {st.cached + self._rows(st)} rows; raise kv.pool "
                                   f"(TFQ_KV_POOL) or the budget")
                else:  # older streams hold the pages: wait for them
                    self._preempt(st, lanes, waiting)
                break
            else:
                ready.append(st)
        return ready

    def _rows(self, st: Stream) -> int:
        return min(st.pending, self.settings.prefill_chunk) + len(st.drafts)

    def _propose(self, running: list[Stream]) -> None:
        """Guesses for streams past their prompt, within their token and window budgets."""
        for st in running:
            st.drafts = []
        if self.drafter is None:
            return
        decoding = [st for st in running if st.pending == 1 and st.finish is None]
        budgets = [max(0, min(self.drafter.k, st.request.max_tokens - len(st.digests) - 1,
                              self.settings.window - len(st.tokens))) for st in decoding]
        for st, guess in zip(decoding, self.drafter.propose(decoding, budgets)):
            st.drafts = list(guess)
            st.proposed += len(st.drafts)

    def _step(self, running: list[Stream], start: float, on_token: OnToken | None) -> None:
        feeds = []
        for st in running:
            n = min(st.pending, self.settings.prefill_chunk)
            done = st.cached + n == len(st.tokens)
            feeds.append(Feed(st.placement, st.cached, st.tokens[st.cached:st.cached + n] + st.drafts,
                              logits=(1 + len(st.drafts)) if done else 0))
        logits = forward(self.model, self.cache, feeds, self._partial(running))
        self.forwards += 1
        for st, f, rows in zip(running, feeds, logits):
            if not f.logits:
                st.cached += len(f.tokens)
                continue
            st.cached += len(f.tokens) - len(st.drafts) - 1  # rows before the one that draws
            for j, row_logits in enumerate(rows):
                st.cached += 1
                self._draw(st, row_logits, start, on_token)
                if st.finish is not None or j == len(st.drafts) or st.tokens[-1] != st.drafts[j]:
                    break
                st.accepted += 1
            if st.drafts:
                st.verifies += 1
                self.cache.shrink(st.placement, st.cached)  # rejected rows give their pages back
                self.drafter.settle(st)

    def _partial(self, running: list[Stream]) -> bool:
        s = self.settings
        return s.partial or (s.paged_partial and any(st.placement.paged for st in running))

    def _draw(self, st: Stream, logits: torch.Tensor, start: float, on_token: OnToken | None) -> None:
        req = st.request
        st.digests.append(digest(logits))
        if self.keep_logits:
            st.logits.append(logits.clone())
        token = sample(logits, req.temperature, req.top_p, req.seed, len(st.tokens))
        st.tokens.append(token)
        if len(st.digests) == 1:
            st.first_token_s = time.perf_counter() - start
        before = len(st.text)
        if token in self.eos_ids:
            st.finish = "eos"
        elif st.decoder is not None:
            st.text += st.decoder.feed(token)
        stop = next((s for s in req.stop if s in st.text), None)
        if stop is not None:
            st.text = st.text[:st.text.index(stop)]
            st.finish = "stop"
        elif st.finish is None and len(st.digests) >= req.max_tokens:
            st.finish = "length"
        elif st.finish is None and len(st.tokens) >= self.settings.window:
            st.finish = "window"
        if st.finish not in (None, "stop") and st.decoder is not None:
            st.text += st.decoder.flush()  # a character cut at the very end still shows
        if on_token is not None:
            on_token(st.index, token, st.text[before:])

    # -- leaving ------------------------------------------------------------------------------------------
    def _preempt(self, st: Stream, lanes, waiting: deque) -> None:
        """Free a stream's pages and requeue it; it recomputes its cache (prompt and reply) when readmitted."""
        self.cache.release(st.placement)
        if self.drafter is not None:
            self.drafter.forget(st)
        lanes[st.lane] = None
        st.preempted += 1
        st.recomputed += st.cached > 0  # sent back with cached work, which it computes again
        st.lane, st.placement, st.cached, st.drafts = None, None, 0, []
        waiting.appendleft(st)

    def _leave(self, st: Stream, lanes) -> None:
        if self.drafter is not None:
            self.drafter.forget(st)
        if st.placement is not None:
            self.cache.release(st.placement)
        if st.lane is not None:
            lanes[st.lane] = None
        st.lane, st.placement = None, None

    def _fail(self, st: Stream, message: str) -> None:
        st.finish, st.error = "error", message

    def _result(self, st: Stream, total: float) -> Result:
        return Result(label=st.request.label, ids=st.reply, text=st.text, digests=st.digests, finish=st.finish or "error",
                      error=st.error, prompt_tokens=len(st.request.prompt), first_token_s=st.first_token_s,
                      total_s=total, preempted=st.preempted, recomputed=st.recomputed,
                      proposed=st.proposed, accepted=st.accepted,
                      verifies=st.verifies, logits=st.logits if self.keep_logits else None)
