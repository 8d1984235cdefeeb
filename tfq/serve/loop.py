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
import threading
import time
from dataclasses import dataclass, field

import torch

from tfq.engine import Engine, Output
from tfq.stream import Request, Result


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
    ids: list[int] = field(default_factory=list)  # engine stream ids, in choice order (set by the engine thread)
    submitted: float = field(default_factory=time.perf_counter)
    last: dict[int, float] = field(default_factory=dict)  # choice -> when its last token came

    def post(self, event: Token | Done) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, engine: Engine, queue: int, metrics=None):
        self.engine = engine
        self.queue = queue  # streams that may wait for a lane beyond those running
        self.metrics = metrics  # tfq.serve.metrics.Metrics or None
        self.threads = torch.get_num_threads()  # the count the engine's guard proved at construction
        self._cond = threading.Condition()
        self._adds: list[Ticket] = []
        self._aborts: list[Ticket] = []
        self._owner: dict[int, tuple[Ticket, int]] = {}  # engine stream id -> (ticket, choice)
        self._in_flight = 0  # streams submitted and not yet finished
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tfq-engine", daemon=True)

    @property
    def capacity(self) -> int:
        return self.engine.settings.lanes + self.queue

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort what is left and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def submit(self, requests: list[Request]) -> Ticket:
        """Queue one HTTP request's streams (from the event loop's thread); Busy when the queue is full."""
        ticket = Ticket(requests, asyncio.Queue(), asyncio.get_running_loop())
        with self._cond:
            if self._stopping:
                raise Busy("the server is shutting down")
            if self._in_flight + len(requests) > self.capacity:
                raise Busy(f"{self._in_flight} streams are running or waiting, the most this server queues is "
                           f"{self.capacity}")
            self._in_flight += len(requests)
            self._adds.append(ticket)
            self._cond.notify()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away: its streams end at the next step and give their lane and pages back."""
        with self._cond:
            self._aborts.append(ticket)
            self._cond.notify()

    # -- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # torch's count is per thread: start this one where the guard proved
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stopping or self.engine.has_work()):
                    self._cond.wait()
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
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a fault in the engine itself: every stream in flight fails, the loop goes on
                    self._fail_all(f"the engine failed: {e}")
                    outputs = []
                for out in outputs:
                    self._dispatch(out)
            self._observe()

    def _add(self, ticket: Ticket) -> None:
        for choice, request in enumerate(ticket.requests):
            id_ = self.engine.add(request)
            ticket.ids.append(id_)
            self._owner[id_] = (ticket, choice)
            if self.engine.streams[id_].finish is not None:  # refused at once (a prompt over the window)
                self._finish(id_)

    def _abort(self, ticket: Ticket) -> None:
        for id_ in ticket.ids:
            if id_ in self._owner:
                self.engine.abort(id_)
                self._finish(id_)

    def _fail_all(self, message: str) -> None:
        for id_ in list(self._owner):
            self.engine.streams[id_].fail(message)
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
        with self._cond:
            self._in_flight -= 1
        self.engine.forget(id_)  # a long-running server keeps nothing of finished streams
        ticket.post(Done(choice, result))

    def _observe(self) -> None:
        if self.metrics is None:
            return
        sched, pages = self.engine.scheduler, self.engine.pages
        prefix = pages.prefix
        self.metrics.engine(waiting=len(sched.waiting), busy=sum(st is not None for st in sched.lanes),
                            free_pages=pages.unheld, preemptions=sched.preemptions, streams=self._in_flight,
                            cached_pages=len(prefix.idle) if prefix else 0, reused=prefix.reused_rows if prefix else 0)
