"""The engine: requests in, tokens out, one forward per step, driven one step at a time.

`add(request)` queues a stream, `step()` runs one forward and returns what each stream drew, `abort(id)`
ends a stream and gives its pages back, `has_work()` says whether anything is left; `generate()` is a loop
over them. A step is schedule -> run -> draw -> update: the scheduler decides (tfq/engine/scheduler.py: admission,
rows, pages, preemption), the runner computes (tfq/engine/runner.py: the drafter's guesses, one forward in the
arithmetic the attention policy picks), the engine draws from the logits (a digest of their bits, the draw,
the stream's stops), and the scheduler books what changed (rows cached, guesses kept, pages, finishing), the
runner rolling a hybrid's state back where a verify kept fewer rows than it fed. The batch's shape never
chooses the arithmetic: only the plan does (or a check's control, handed over as a policy: tfq/engine/runner.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from tfq.decode.grammar import Grammars, Matcher, OwnMask
from tfq.decode.sampling import TokenLogprob, digest, finite, logprob, sample
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.draft import accepted
from tfq.engine.layer_guard import prove
from tfq.engine.prefix import PrefixCache, root_key
from tfq.engine.runner import Policy, Runner, plan_arithmetic
from tfq.engine.scheduler import Scheduler
from tfq.engine.settings import EngineSettings
from tfq.engine.stream import Finish, Request, Result, Status, Stream
from tfq.errors import TfqError, own_fault
from tfq.heap import give_back
from tfq.kernels.contract import RECIPE
from tfq.model.qwen import Qwen
from tfq.plan.layout import auto_logits_rows, prefix_snapshots

log = logging.getLogger(__name__)

OnToken = Callable[[int, int, str], None]  # (request index, token id, newly completed text)


class ForwardFault(RuntimeError):
    """A step's forward raised: the streams in it (`ids`) have failed and given back their lanes and pages."""

    def __init__(self, message: str, ids: list[int]):
        super().__init__(message)
        self.ids = ids


@dataclass(frozen=True)
class Output:
    """One token a stream drew in a step."""

    id: int
    token: int
    text: str  # the text this token made visible (may be empty: half a character, or EOS)
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asks for log-probabilities
    digest: str = ""  # of the logits row the token was drawn from


@dataclass(frozen=True)
class Controls:
    """What a check changes to prove a point, handed over as data (production runs leave it at its default).

    arithmetic: the attention policy and DeltaNet algorithm a forward's rows run in (tfq/engine/runner.py's policies;
    None: the plan's). page_order_seed: the pool hands out pages in an order shuffled by it (paged rows must not
    care where their pages sit). mask: how a constrained row's grammar mask is made (tfq/decode/grammar.py: OwnMask,
    or the control SharedMask). compile: how a stream's matcher is compiled (tfq/decode/grammar.py: OwnCompile, with
    its limits, or the control SharedCompile)."""

    arithmetic: Policy | None = None
    page_order_seed: int | None = None
    mask: Callable | None = None
    compile: Callable | None = None
    snapshot_offset: int = 0  # a hybrid's prefix cache keeps each state this many rows past its page (control: 1)


class Engine:
    def __init__(self, model: Qwen, settings: EngineSettings, tokenizer=None, eos_ids: Sequence[int] = (),
                 keep_logits: bool = False, drafter=None, threads=None, controls: Controls = Controls()):
        self.model = model
        self.settings = s = settings
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids or (tokenizer.eos_ids if tokenizer is not None else ()))
        self.keep_logits = keep_logits
        self.threads = threads  # tfq.engine.threads.Threads (the CPU thread count follows the load) or None
        prefix = None
        if s.prefix_cache and s.page_rows:  # what besides the tokens decides a cached row's bits
            prefix = PrefixCache(root_key(model.config, model.backend.name, s.kv_dtype, s.partial))
        spec = CacheSpec(lanes=s.contiguous_lanes, window=s.window, page_rows=s.page_rows, pool_pages=s.pool_pages,
                         dtype=s.kv_dtype, slots=s.lanes, verify_rows=1 + drafter.k if drafter is not None else 0,
                         snapshots=prefix_snapshots(s.lanes) if prefix is not None and model.config.hybrid else 0)
        self.cache = KVCache(model.config, spec, page_order_seed=controls.page_order_seed, backend=model.backend,
                             prefix=prefix, snapshot_offset=controls.snapshot_offset)
        if prefix is not None and s.prefix_store:
            if not s.model_identity:
                raise TfqError("kv.prefix_store needs the model's identity (its sha256) to name its pages on disk; "
                               "build the engine with Engine.from_plan")
            # on disk the root also names the weights and tfq's recipe: pages outlive this process and its model
            self.cache.keep_on_disk(s.prefix_store, root_key(prefix.root, s.model_identity, RECIPE),
                                    s.prefix_store_bytes)
        self.pages = self.cache.pages
        self.runner = Runner(model, self.cache, controls.arithmetic or plan_arithmetic(s.partial), drafter)
        least = s.lanes * self.drawing_rows
        if s.logits_rows and s.logits_rows < least:
            raise TfqError(f"logits_rows {s.logits_rows} is fewer than the rows every lane draws from at once "
                           f"({s.lanes} lanes x {self.drawing_rows}); set logits_rows to {least} or more")
        logits_rows = s.logits_rows or auto_logits_rows(s.lanes, s.prefill_chunk, self.drawing_rows)
        self.scheduler = Scheduler(replace(s, logits_rows=logits_rows), self.pages)  # its settings: auto resolved
        self.streams: dict[int, Stream] = {}
        self._next_id = 0
        self._grammars: Grammars | None = None  # built on the first constrained request (about a second)
        self._grammars_once = threading.Lock()  # a server compiles grammars in its request threads
        self.mask = controls.mask or OwnMask()
        self._compile = controls.compile
        self._running = None  # the step running now (its expected seconds are asked by the server's watchdog)
        self.proof = None  # tfq.engine.layer_guard.LayerProof: the model's layer proved row-invariant here
        if not model.backend.interpreted:  # under Triton's interpreter the tests prove the same, faster
            self.proof = prove(model, s.kv_dtype, s.partial, torch.get_num_threads(), self.largest_forward,
                               s.prefill_chunk, self.drawing_rows)
            give_back()  # the proof's forwards freed tens of MB between what the engine keeps (tfq/heap.py)

    @property
    def largest_forward(self) -> int:
        """Most rows one forward can hold: a prompt chunk, or a drafted verify, in every lane."""
        return self.settings.lanes * max(self.settings.prefill_chunk, self.drawing_rows)

    @property
    def drafter(self):
        """tfq.engine.draft.Drafter or None (the runner's)."""
        return self.runner.drafter

    @property
    def drawing_rows(self) -> int:
        """Most rows one stream draws from in a forward: a verify of every guess and the next token."""
        return 1 + (self.drafter.k if self.drafter is not None else 0)

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    @classmethod
    def from_plan(cls, plan, layout, loaded, **kw) -> "Engine":
        """plan: tfq.plan.Plan, layout: its Layout, loaded: tfq.model.load.LoadedModel."""
        from tfq.engine.draft import make_drafter
        from tfq.engine.threads import Threads

        settings = EngineSettings.from_plan(plan, layout)
        if settings.prefix_store:
            from tfq.model.identity import weights_sha256

            settings = replace(settings, model_identity=f"{weights_sha256(plan.model)}/{loaded.weights}")
        if "drafter" not in kw:
            kw["drafter"] = make_drafter(plan.draft, loaded, settings.lanes, settings.window)
        if "threads" not in kw:
            kw["threads"] = Threads.auto() if loaded.model.backend.name == "torch" else None
        return cls(loaded.model, settings, loaded.tokenizer, **kw)

    # -- one step at a time ---------------------------------------------------------------------------------
    def add(self, request: Request, grammar: Matcher | None = None) -> int:
        """Queue a request; its id. A prompt that cannot fit the window finishes at once with an error.
        grammar: the stream's matcher, compiled already (a server compiles off the engine's thread); else the
        request's constraint is compiled here."""
        request.validate()
        request.penalties.validate(request.label or "request", self.model.config.vocab_size)  # bias on real ids
        st = Stream(self._next_id, request, list(request.prompt),
                    decoder=self.tokenizer.stream() if self.tokenizer else None)
        self._next_id += 1
        self.streams[st.id] = st
        vocab = self.model.config.vocab_size
        outside = next((i for i, token in enumerate(request.prompt) if not 0 <= token < vocab), None)
        if outside is not None:  # refused at once: the embedding has no such row
            st.fail(f"{request.label or 'request'}: prompt token {request.prompt[outside]} at position {outside} is "
                    f"not an id of the model's vocabulary; give ids in [0, {vocab})")
            st.status = Status.FINISHED
            return st.id
        for token in request.resumed:  # its text, stops and budget as the stream that drew them had them
            if not 0 <= token < vocab or st.finish is not None:
                st.fail(f"{request.label or 'request'}: resumed token {token} is not a token of a reply going on "
                        f"(an id in [0, {vocab}), none after its end)")
                st.status = Status.FINISHED
                return st.id
            st.append(token, self.eos_ids, self.settings.window)
        if st.finish is not None:  # the resumed tokens ended it (EOS, a stop, the window)
            st.fail(f"{request.label or 'request'}: the resumed reply had already ended ({st.finish}); nothing to draw")
            st.status = Status.FINISHED
            return st.id
        if request.constraint is not None:
            try:
                st.grammar = grammar or self.grammars.matcher(request.constraint)
            except TfqError as e:  # refused at once, as a prompt over the window is
                st.fail(str(e))
                st.status = Status.FINISHED
                return st.id
        self.scheduler.add(st)
        return st.id

    @property
    def expected_s(self) -> float | None:
        """What the step running now should take, by the cost learned so far (None before it is learned). Asked
        when a watchdog looks, not solved at every step."""
        step = self._running
        return None if step is None else self.scheduler.expected_seconds(step)

    @property
    def grammars(self) -> Grammars:
        """The model's grammars (tfq/decode/grammar.py): what compiles a request's constraint."""
        with self._grammars_once:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise TfqError("a constrained reply needs the model's tokenizer; load the model with it")
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_ids,
                                          probes=self.drafter is not None, compile_=self._compile)
        return self._grammars

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Output]:
        """One forward: what every stream that reached the end of its rows drew."""
        start = time.perf_counter()  # the step's time, all of it a token waits on: what the step budget learns
        proposed = self.runner.propose(*self.scheduler.guess_budgets(self.drawing_rows - 1))
        guesses, failed = self._grammatical(proposed)
        step = self.scheduler.schedule(guesses)
        self._running = step
        outputs = [Output(st.id, -1, "", True) for st in failed + step.failed]
        if step.scheduled:
            if self.threads is not None:
                self.threads.step(self._proved)
            drawn = [self._draw_rows(s.stream, s.feed, rows, self.runner.drawn(i))
                     for i, (s, rows) in enumerate(zip(step.scheduled, self._forward(step)))]
            self.runner.settle(self.scheduler.update(step, [len(d) for d in drawn], time.perf_counter() - start))
            outputs += [out for d in drawn for out in d]
        return outputs

    def _forward(self, step) -> list[torch.Tensor]:
        """The step's forward; when it raises, the streams in it fail (their lanes and pages go back, the rest
        wait on) and ForwardFault says which."""
        try:
            return self.runner.run(step.feeds)
        except Exception as e:
            message = f"the forward failed: {type(e).__name__}: {e}"
            log.exception("the forward of %d streams failed", len(step.streams))
            for st in step.streams:
                st.fail(message, fault=True)
                self.scheduler.finish(st)
            raise ForwardFault(message, [st.id for st in step.streams]) from e

    def abort(self, id: int) -> None:
        """End a stream now, wherever it is; its lane and pages go back at once."""
        st = self.streams[id]
        if st.status is not Status.FINISHED:
            st.finish = st.finish or Finish.ABORT
            self.scheduler.finish(st)

    def result(self, id: int) -> Result:
        return self.streams[id].result(self.keep_logits)

    def forget(self, id: int) -> None:
        """Drop a finished stream's record (a server running for days keeps none)."""
        if self.streams[id].status is Status.FINISHED:
            del self.streams[id]

    def close(self) -> None:
        """The pages handed to the prefix store written to disk and its thread ended (also done at exit)."""
        if self.pages.store is not None:
            self.pages.store.close()

    def generate(self, requests: Sequence[Request], on_token: OnToken | None = None) -> list[Result]:
        """Run requests to the end; results in their order. on_token(request index, token id, new text)."""
        for r in requests:
            r.validate()
        start = time.perf_counter()
        ids = [self.add(r) for r in requests]
        index = {id_: i for i, id_ in enumerate(ids)}
        try:
            while self.has_work():
                for out in self.step():
                    if on_token is not None and out.token >= 0:
                        on_token(index[out.id], out.token, out.text)
        except ForwardFault as e:  # a run to the end stops at a failed forward, with what failed (one line if it
            raise e.__cause__ from None  # is the user's to mend, e.g. a tensor-parallel rank that stopped)
        finally:
            for id_ in ids:  # an interrupted run gives every page back
                self.abort(id_)
            if self.threads is not None:
                self.threads.restore()
        total = time.perf_counter() - start
        results = [self.streams[id_].result(self.keep_logits, total) for id_ in ids]
        for id_ in ids:  # a caller looping over generate keeps nothing of finished streams
            self.forget(id_)
        return results

    # -- applying a forward ---------------------------------------------------------------------------------
    def _draw_rows(self, st: Stream, feed, rows: torch.Tensor, facts: tuple[bool, int] | None = None) -> list[Output]:
        """One stream's logits rows: the prompt rows score its prompt; then it draws row by row while each draw
        confirms the guess fed after it. When its own work fails (draw, detokenize, stops), it alone fails. `facts`:
        what the model's one object said of its one row (Runner.drawn)."""
        try:
            draws = 1 + feed.guesses if feed.start + feed.chunk == len(st.tokens) else 0  # 0: short of the end
            n = rows.shape[0]  # (len and slices of a tensor cost microseconds each, every step)
            if n > draws:  # rows before the drawing ones: the request scores its prompt
                self._score_prompt(st, feed.start + len(feed.tokens) - feed.logits, rows[:n - draws])
            guesses, outputs = feed.tokens[feed.chunk:], []
            for row_logits in (rows if n == draws else rows[n - draws:]).unbind(0):
                outputs.append(self._draw(st, row_logits, facts if n == 1 else None))
                # the next row was fed the guess after this draw's: it counts only while every draw confirms
                if st.finish is not None or accepted(guesses, [o.token for o in outputs]) < len(outputs):
                    break
            return outputs
        except BaseException as e:
            if not own_fault(e):
                raise
            self._fail(st, "drawing its token", e)
            return [Output(st.id, -1, "", True)]

    def _fail(self, st: Stream, doing: str, e: BaseException) -> None:
        """A stream's own work raised (its grammar, penalties, text, stops): it alone fails."""
        log.error("stream %d failed %s", st.id, doing, exc_info=e)
        st.fail(f"the stream failed while {doing}: {type(e).__name__}: {e}", fault=True)

    def _draw(self, st: Stream, logits: torch.Tensor, facts: tuple[bool, int] | None = None) -> Output:
        """`facts`: (every value finite, the first largest) as the one object found them where its head wrote
        the row, the same answers as numpy's here (kernels/cpu/row_facts.h), read there for speed."""
        req = st.request
        if not (facts[0] if facts is not None else finite(logits)):
            raise FloatingPointError(f"the logits row at position {len(st.tokens)} is not finite")
        st.digests.append(digest(logits))
        if self.keep_logits:
            st.logits.append(logits.clone())
        shaped = self._shaped(st, logits)
        greedy = facts is not None and shaped is logits and req.temperature <= 0  # the model's row, its largest
        token = facts[1] if greedy else sample(shaped, req.temperature, req.top_p, req.seed, len(st.tokens))
        scored = logprob(logits, token, req.logprobs) if req.logprobs is not None else None
        if scored is not None:
            st.logprobs.append(scored)
        text = st.append(token, self.eos_ids, self.settings.window)
        return Output(st.id, token, text, st.finish is not None, scored, st.digests[-1])

    def _shaped(self, st: Stream, logits: torch.Tensor) -> torch.Tensor:
        """The row the token is drawn from: the model's, then the request's penalties, then its grammar's mask
        (each a function of the row and the stream's own tokens). Log-probabilities and digests stay the
        model's: the scores of the same tokens without them."""
        req = st.request
        if req.penalties:
            logits = req.penalties.apply(logits, req.prompt, st.reply)
        if st.grammar is not None:
            st.grammar.at(st.reply)
            allowed = self.mask(st.grammar)
            if not allowed.any():
                raise TfqError("the grammar allows no token here")
            logits = torch.where(torch.from_numpy(allowed[:len(logits)]), logits, float("-inf"))
        return logits

    def _grammatical(self, guesses: dict[int, list[int]]) -> tuple[dict[int, list[int]], list[Stream]]:
        """A drafter's guesses cut where a stream's grammar would refuse one (it could never be drawn); and the
        streams whose grammar failed on them, finished alone."""
        failed = []
        for id_, g in list(guesses.items()):
            st = self.streams[id_]
            if st.grammar is None:
                continue
            try:
                guesses[id_] = g[:st.grammar.valid_prefix(st.reply, g)]
            except BaseException as e:
                if not own_fault(e):
                    raise
                del guesses[id_]
                self._fail(st, "checking its drafted tokens", e)
                self.scheduler.finish(st)
                failed.append(st)
        return guesses, failed

    def _score_prompt(self, st: Stream, first: int, rows: torch.Tensor) -> None:
        """Row i (position first + i) scores the prompt token after it; once, even when recomputed."""
        prompt, top = st.request.prompt, st.request.prompt_logprobs
        for i, row in enumerate(rows):
            nxt = first + i + 1
            if nxt < len(prompt) and nxt not in st.prompt_logprobs:
                st.prompt_logprobs[nxt] = logprob(row, prompt[nxt], top)

    def _proved(self, threads: int) -> bool:
        """Whether the thread policy may switch to `threads` (proved once, on first wish)."""
        return self.proof is None or self.proof.holds(threads, self.largest_forward, self.settings.prefill_chunk,
                                                      self.drawing_rows) is None
