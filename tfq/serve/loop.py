"""The engine in its own thread, stepping while there is work: requests join the running batch at the next
step and leave when done.

The HTTP side never touches the engine: it hands a `Ticket` (one HTTP request's streams) to `submit`, and asks
`abort` when its client goes away. The engine thread takes both between steps, steps, and sends every drawn
token to its ticket's asyncio queue through the event loop (`call_soon_threadsafe`). Nothing a request sends
reaches another request's stream: each stream's bits are its own (the exactness rule), and a stream that
fails finishes alone.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tfq.decode.grammar import Matcher
from tfq.engine.core import Engine, ForwardFault, Output
from tfq.engine.stream import Finish, Request, Result
from tfq.engine.threads import release_workers
from tfq.errors import TfqError, Unservable, own_fault

log = logging.getLogger(__name__)


class Busy(Exception):
    """The queue is full: the caller answers 429 with Retry-After."""


@dataclass
class Token:
    choice: int
    output: Output


@dataclass
class Done:
    choice: int
    result: Result


@dataclass
class Ticket:
    """One HTTP request's streams (one per prompt and choice) and where their events go."""

    requests: list[Request]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    matchers: list[Matcher | None] | None = None  # each choice's grammar, compiled off the engine's thread
    ids: list[int] = field(default_factory=list)  # engine stream ids, in choice order (set by the engine thread)
    submitted: float = field(default_factory=time.perf_counter)
    last: dict[int, float] = field(default_factory=dict)  # choice -> when its last token came

    def post(self, event: Token | Done) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


NO_STREAM = -1  # a choice's id when it could not be added (it was answered with its error at once)
FORWARD_FAULTS = 3  # forwards failing in a row that mean the engine cannot serve: the server goes down
STUCK_AFTER_S = 300.0  # a step may always run this long (a step of a 27B model's first rows on 2 cores fits)
STUCK_TIMES = 10  # and this many times what its rows should take by the cost of steps learned here


def stuck_bound(stuck_after_s: float, expected_s: float | None) -> float:
    """How long a step may run before the engine is called stuck: the floor, or STUCK_TIMES what the step
    should take (a long prefill of a large model on few cores is slow, not stuck)."""
    return stuck_after_s if expected_s is None else max(stuck_after_s, STUCK_TIMES * expected_s)


class Dead(Exception):
    """The engine cannot serve any more (its thread ended, a step is stuck, or forwards keep failing): the
    caller answers 503, /health says so, and the server exits non-zero."""


class EngineLoop:
    def __init__(self, engine: Engine, queue: int, metrics=None, stuck_after_s: float = STUCK_AFTER_S):
        self.engine = engine
        self.queue = queue  # streams that may wait for a lane beyond those running
        self.metrics = metrics  # tfq.serve.metrics.Metrics or None
        self.stuck_after_s = stuck_after_s
        self.on_dead: Callable[[str], None] | None = None  # told once, from whichever thread found it dead
        self.threads = torch.get_num_threads()  # the count the engine's guard proved at construction
        release_workers()  # built on this thread, stepped on the engine thread: one pool of workers, not two
        self._cond = threading.Condition()
        self._adds: list[Ticket] = []
        self._aborts: list[Ticket] = []
        self._owner: dict[int, tuple[Ticket, int]] = {}  # engine stream id -> (ticket, choice)
        self._live: dict[int, Ticket] = {}  # by id(): tickets with a choice unfinished (what a death answers)
        self._in_flight = 0  # streams submitted and not yet finished
        self._stopping = False
        self._faults = 0  # forwards failed in a row
        self._step_since: float | None = None  # when the step running now began (None between steps)
        self.dead: str | None = None  # why the engine cannot serve, once it cannot
        self._thread = threading.Thread(target=self._run, name="tfq-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="tfq-watchdog", daemon=True)

    @property
    def capacity(self) -> int:
        return self.engine.settings.lanes + self.queue

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self) -> None:
        """Abort what is left and end the thread (a stuck one is left behind: it is a daemon), then the engine."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.dead is None:
            self._thread.join()
        self.engine.close()

    def health(self) -> tuple[bool, dict]:
        """(serving, what /health says): the engine thread's state, and how long the step now running has run."""
        self._check_alive()
        step_s = None if self._step_since is None else time.perf_counter() - self._step_since
        state = {"engine": "dead" if self.dead else ("stepping" if step_s is not None else "idle"),
                 "streams": self._in_flight}
        if step_s is not None:
            state["step_s"] = round(step_s, 3)
        if self.dead:
            state["reason"] = self.dead
        return self.dead is None, state

    def submit(self, requests: list[Request], matchers: list[Matcher | None] | None = None) -> Ticket:
        """Queue one HTTP request's streams (from the event loop's thread), with their grammars' matchers if
        any; Busy when the queue is full, Dead when the engine cannot serve."""
        ticket = Ticket(requests, asyncio.Queue(), asyncio.get_running_loop(), matchers)
        self._check_alive()
        with self._cond:
            if self.dead:
                raise Dead(self.dead)
            if self._stopping:
                raise Busy("the server is shutting down")
            if self._in_flight + len(requests) > self.capacity:
                raise Busy(f"{self._in_flight} streams are running or waiting, the most this server queues is "
                           f"{self.capacity}")
            self._in_flight += len(requests)
            self._live[id(ticket)] = ticket
            self._adds.append(ticket)
            self._cond.notify_all()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away: its streams end at the next step and give their lane and pages back."""
        with self._cond:
            self._aborts.append(ticket)
            self._cond.notify_all()

    def die(self, reason: str) -> None:
        """The engine cannot serve: every request still waiting gets its error now, new ones get 503, and
        on_dead is told (the server then exits non-zero). Called once, from any thread."""
        with self._cond:
            if self.dead is not None:
                return
            self.dead = reason
            tickets, self._live = list(self._live.values()), {}
            self._cond.notify_all()
        log.error("the engine cannot serve: %s", reason)
        for ticket in tickets:
            for choice, request in enumerate(ticket.requests):
                ticket.post(Done(choice, Result(request.label, [], "", [], Finish.ERROR,
                                                error=f"the engine stopped: {reason}", fault=True)))
        if self.on_dead is not None:
            self.on_dead(reason)

    def _check_alive(self) -> None:
        """An engine thread that ended without saying why (nothing should escape _run, but a health check
        trusts no thread it has not seen alive) makes the engine dead."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            self.die("the engine thread has ended")

    # -- the watchdog ---------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A step running past its bound (stuck_bound) means the engine is stuck: it is declared dead."""
        with self._cond:
            while not (self._stopping or self.dead):
                since, bound = self._step_since, stuck_bound(self.stuck_after_s, self.engine.expected_s)
                if since is not None and time.perf_counter() - since > bound:
                    break
                wait = bound if since is None else since + bound - time.perf_counter()
                self._cond.wait(max(wait, 0.0) + 0.01)  # woken at each step's start too: it looks again then
            else:
                return
        self.die(f"one step has run for over {bound:g} s")

    # -- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # torch's count is per thread: start this one where the guard proved
        try:
            self._loop()
        except BaseException as e:  # a fault outside any one stream (a Rust panic too): the engine's state is
            log.exception("the engine loop failed")  # unknown, so it stops
            self.die(f"the engine loop failed: {type(e).__name__}: {e}")
            self._give_back()

    def _give_back(self) -> None:
        """After a death on this thread: every stream's lane and pages back, as far as the engine still can."""
        for id_ in list(self._owner):
            try:
                self.engine.abort(id_)
            except Exception:  # the engine's state is what failed: what cannot be given back stays
                log.exception("stream %d could not be aborted", id_)
        self._owner.clear()
        with self._cond:
            self._in_flight = 0
        try:
            self._observe()
        except Exception:
            log.exception("the metrics could not be updated")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stopping or self.dead or self.engine.has_work()):
                    self._cond.wait()
                if self.dead:
                    return
                adds, aborts, stopping = self._adds, self._aborts, self._stopping
                self._adds, self._aborts = [], []
            for ticket in adds:
                self._add(ticket)
            for ticket in aborts + (list({id(t): t for t, _ in self._owner.values()}.values()) if stopping else []):
                self._abort(ticket)
            if stopping:
                self._observe()
                return
            if self.engine.has_work():
                outputs = self._step()
                if self.dead:  # a step that outlived the watchdog: its requests were answered already
                    return
                for out in outputs:
                    self._dispatch(out)
            self._observe()

    def _step(self) -> list[Output]:
        """One engine step, timed for the watchdog; a forward that fails fails its own streams, and several in a
        row mean the engine cannot serve."""
        with self._cond:
            self._step_since = time.perf_counter()
            self._cond.notify_all()
        try:
            outputs = self.engine.step()
            self._faults = 0
            return outputs
        except ForwardFault as e:
            self._faults += 1
            for id_ in e.ids:
                if id_ in self._owner:
                    self._finish(id_)
            if isinstance(e.__cause__, Unservable):
                raise RuntimeError(str(e.__cause__)) from e
            if self._faults >= FORWARD_FAULTS:
                raise RuntimeError(f"{self._faults} forwards failed in a row, the last: {e}") from e
            return []
        finally:
            with self._cond:
                self._step_since = None

    def _add(self, ticket: Ticket) -> None:
        for choice, request in enumerate(ticket.requests):
            try:
                id_ = self.engine.add(request, ticket.matchers[choice] if ticket.matchers else None)
            except BaseException as e:  # the request's own fault: it fails alone, before it holds anything
                if not own_fault(e):
                    raise
                self._refuse(ticket, choice, e)
                continue
            ticket.ids.append(id_)
            self._owner[id_] = (ticket, choice)
            if self.engine.streams[id_].finish is not None:  # refused at once (a prompt over the window)
                self._finish(id_)

    def _refuse(self, ticket: Ticket, choice: int, e: BaseException) -> None:
        log.error("a stream could not be added", exc_info=e)
        ticket.ids.append(NO_STREAM)
        request = ticket.requests[choice]
        ticket.post(Done(choice, Result(request.label, [], "", [], Finish.ERROR, error=str(e) if isinstance(e, TfqError)
                                        else f"the stream could not start: {type(e).__name__}: {e}",
                                        fault=not isinstance(e, TfqError))))
        self._one_done(ticket)

    def _abort(self, ticket: Ticket) -> None:
        for id_ in ticket.ids:
            if id_ in self._owner:
                self.engine.abort(id_)
                self._finish(id_)

    def _dispatch(self, out: Output) -> None:
        if out.id not in self._owner:
            return
        ticket, choice = self._owner[out.id]
        if out.token >= 0:
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.token(now - ticket.last.get(choice, ticket.submitted), first=choice not in ticket.last)
            ticket.last[choice] = now
            ticket.post(Token(choice, out))
        if out.finished:
            self._finish(out.id)

    def _finish(self, id_: int) -> None:
        ticket, choice = self._owner.pop(id_)
        result = self.engine.result(id_)
        self._one_done(ticket)
        self.engine.forget(id_)  # a long-running server keeps nothing of finished streams
        ticket.post(Done(choice, result))

    def _one_done(self, ticket: Ticket) -> None:
        """One of the ticket's choices is answered; once all are, a death has nothing left to answer for it."""
        with self._cond:
            self._in_flight -= 1
            if all(i not in self._owner for i in ticket.ids) and len(ticket.ids) == len(ticket.requests):
                self._live.pop(id(ticket), None)

    def _observe(self) -> None:
        if self.metrics is None:
            return
        self.metrics.engine(self.engine.scheduler.stats(), streams=self._in_flight)
