"""A server's grammar compiles (tfq/serve/compiles.py): off the engine's thread, bounded in number (429 past it)
and in time (400 past it), the count of waiting compiles right however a request ends."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from served import NAME, eventually, raw, server, tiny_served
from tfq.decode.grammar import Constraint, Grammars
from tfq.serve.background import serving
from tfq.serve.compiles import Compiles, Crowded, TooSlow

REGEX = Constraint("regex", "[ab]{4}")


class HeldGrammars:
    """Compiles that wait until the test lets them go."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def matcher(self, constraint: Constraint) -> str:
        self.started.set()
        assert self.release.wait(60)
        return f"matcher of {constraint.source}"


def test_compiles_past_the_waiting_bound_are_refused_and_the_count_comes_back():
    compiles, held = Compiles(threads=1, waiting=3, wait_s=60), HeldGrammars()

    async def main():
        first = asyncio.ensure_future(compiles.matchers(held, REGEX, 2))
        assert await asyncio.to_thread(held.started.wait, 60)
        with pytest.raises(Crowded, match="2 grammar compiles are waiting, the most this server keeps is 3"):
            await compiles.matchers(held, REGEX, 2)
        held.release.set()
        assert await first == ["matcher of [ab]{4}"] * 2
        assert compiles.waiting == 0
        assert len(await compiles.matchers(held, REGEX, 3)) == 3  # room again

    asyncio.run(main())


def test_a_compile_past_the_time_bound_is_refused_and_still_counted_until_it_ends():
    compiles, held = Compiles(threads=1, waiting=8, wait_s=0.2), HeldGrammars()

    async def main():
        with pytest.raises(TooSlow, match="its grammar took over 0.2 s to compile; send a simpler one"):
            await compiles.matchers(held, REGEX, 1)
        assert compiles.waiting == 1  # the thread still holds it
        held.release.set()
        assert await asyncio.to_thread(eventually, lambda: compiles.waiting == 0)

    asyncio.run(main())


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


def test_the_engine_thread_never_compiles_a_grammar(tiny, monkeypatch):
    """Every matcher of a served constrained request (n choices) is compiled on a compile thread; the engine's
    thread only follows them."""
    threads = []
    real = Grammars.matcher

    def matcher(self, constraint):
        threads.append(threading.current_thread().name)
        return real(self, constraint)

    monkeypatch.setattr(Grammars, "matcher", matcher)
    with serving(server(tiny)) as base:
        status, _, body = raw(base, "POST", "/v1/completions", json.dumps(
            {"model": NAME, "prompt": "pick", "max_tokens": 6, "n": 3, "structured_outputs": {"regex": "[ab]{6}"}}
        ).encode())
    assert status == 200 and [len(c["text"]) for c in json.loads(body)["choices"]] == [6, 6, 6]
    assert len(threads) == 3 and all(name.startswith("tfq-grammar") for name in threads), threads
