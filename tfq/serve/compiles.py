"""A constrained request's grammars, compiled for the server: off the engine's thread and the event loop, bounded.

Each choice of a constrained request gets a matcher of its own (tfq/decode/grammar.py), compiled before the request is
queued, on a pool of THREADS threads kept for compiles (not asyncio's default pool, which tokenizes): the engine's
thread never compiles and takes no lock a compile holds. llguidance's limits (tfq.decode.grammar.LIMITS) bound each
compile's work; on top of them a request waits at most WAIT_S for its compiles (then 400: its grammar is too
costly), and at most WAITING compiles wait for a thread (past that 429, as a full queue).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from tfq.decode.grammar import Constraint, Grammars, Matcher

THREADS = 2  # compiles at once: a grammar compiles in well under a millisecond to tens of them (llguidance)
WAITING = 256  # matchers waiting for a thread, in all requests (a request's n counts n)
WAIT_S = 10.0  # a request's compiles, waiting included


class Crowded(Exception):
    """Too many compiles are waiting: the caller answers 429."""


class TooSlow(Exception):
    """The request's compiles took over WAIT_S: the caller answers 400."""


class Compiles:
    def __init__(self, threads: int = THREADS, waiting: int = WAITING, wait_s: float = WAIT_S):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tfq-grammar")
        self.most, self.wait_s = waiting, wait_s
        self._waiting = 0
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return self._waiting

    async def matchers(self, grammars: Grammars, constraint: Constraint, n: int) -> list[Matcher]:
        """n matchers of the constraint, one a choice; TfqError when llguidance refuses the grammar."""
        with self._lock:
            if self._waiting + n > self.most:
                raise Crowded(f"{self._waiting} grammar compiles are waiting, the most this server keeps is "
                              f"{self.most}")
            self._waiting += n

        def compile_all() -> list[Matcher]:
            try:
                return [grammars.matcher(constraint) for _ in range(n)]
            finally:  # counted until the thread is done with them, even when the request stopped waiting
                with self._lock:
                    self._waiting -= n

        future = asyncio.wrap_future(self._pool.submit(compile_all))
        done, _ = await asyncio.wait({future}, timeout=self.wait_s)  # never cancels it: the count stays right
        if not done:
            raise TooSlow(f"its grammar took over {self.wait_s:g} s to compile; send a simpler one")
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
