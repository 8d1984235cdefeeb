"""The scheduler's decisions end to end, without a model: the real Engine on a stub whose logits rows hash the
tokens the cache holds (tests/stub_model.py). Replies alone equal replies together, chunked, paged and preempted,
drafted with guesses kept and refused, bit for bit; the control (rows whose bits depend on their batch) is RED.
The forwards the engine ran are recorded by the arithmetic policy it is handed (data, as every check's)."""
from __future__ import annotations

import random

import pytest
import torch

from stub_model import VOCAB, Guesser, StubModel
from tfq.engine.batch import Arithmetic, Feed
from tfq.engine.core import Controls, Engine, EngineSettings
from tfq.engine.draft import accepted
from tfq.engine.stream import Request
from tfq.kernels.contract import KEY_TILE

WINDOW = 256
MOST_STEPS = 1000  # the runs here take at most a few hundred
SHAPES = [(40, 12), (150, 9), (7, 14), (90, 10), (33, 8)]  # (prompt tokens, max tokens)


def requests() -> list[Request]:
    g = random.Random(12)
    return [Request(tuple(g.randrange(VOCAB) for _ in range(n)), max_tokens=t, label=f"r{i}")
            for i, (n, t) in enumerate(SHAPES)]


class Recorder:
    """The plan's arithmetic, and every forward's feeds as (start, tokens, logits rows, guesses)."""

    def __init__(self) -> None:
        self.forwards: list[list[tuple[int, list[int], int, int]]] = []

    def __call__(self, feeds: list[Feed]) -> Arithmetic:
        self.forwards.append([(f.start, list(f.tokens), f.logits, f.guesses) for f in feeds])
        return Arithmetic()


def run(model, reqs, drafter=None, **fields):
    """Results and the recorded forwards of one engine (one lane, window 256 unless given), stepped as a server
    steps it; a scheduler that stops making progress fails the test instead of looping."""
    record = Recorder()
    engine = Engine(model, EngineSettings(**{"window": WINDOW, "lanes": 1, **fields}), eos_ids=(), drafter=drafter,
                    controls=Controls(arithmetic=record, page_order_seed=fields.get("pool_pages")))
    ids = [engine.add(r) for r in reqs]
    for _ in range(MOST_STEPS):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), f"not done in {MOST_STEPS} steps"
    return [engine.result(i) for i in ids], record.forwards, engine


def bits(results) -> list[tuple[list[int], list[str]]]:
    return [(r.ids, r.digests) for r in results]


def alone(model, reqs) -> list[tuple[list[int], list[str]]]:
    return [bits(run(model, [r])[0])[0] for r in reqs]


PAGED = dict(page_rows=KEY_TILE, paged_all=True)
ARMS = {
    "together": dict(lanes=3),
    "chunked": dict(lanes=3, prefill_chunk=29),
    "budget": dict(lanes=3, prefill_chunk=29, step_tokens=8),
    "paged": dict(lanes=3, prefill_chunk=29, pool_pages=12, **PAGED),
    "preempted": dict(lanes=3, prefill_chunk=29, pool_pages=4, **PAGED),
    "prefix": dict(lanes=3, prefill_chunk=29, pool_pages=12, prefix_cache=True, **PAGED),
}


@pytest.mark.parametrize("arm", ARMS)
def test_replies_together_equal_each_alone(arm):
    model = StubModel()
    reqs = requests()
    results, forwards, engine = run(model, reqs, **ARMS[arm])
    assert bits(results) == alone(model, reqs)
    chunk = ARMS[arm].get("prefill_chunk", 512)
    assert all(len(tokens) <= chunk for forward in forwards for _, tokens, _, _ in forward)
    if arm != "together":  # several forwards held several streams, and prompts went in chunks
        assert any(len(f) > 1 for f in forwards)
        assert any(start > 0 and len(t) > 1 for f in forwards for start, t, _, _ in f)
    if arm == "budget":  # a forward that holds a decode holds at most step_tokens rows
        assert all(sum(len(t) for _, t, _, _ in f) <= 8 for f in forwards if any(len(t) == 1 for _, t, _, _ in f))
    if arm == "preempted":
        assert engine.scheduler.preemptions > 0 and sum(r.recomputed for r in results) > 0
    if arm == "prefix":
        assert sum(r.reused for r in results) == 0  # random prompts share no page: nothing to map, nothing wrong


def test_control_rows_that_depend_on_their_batch_change_replies_together():
    """RED by construction: the stub hashes the forward's row count too, so a row's bits depend on its batch."""
    model = StubModel(shaped=True)
    reqs = requests()
    results, _, _ = run(model, reqs, **ARMS["chunked"])
    assert bits(results) != alone(model, reqs)


def test_a_shared_prompt_is_mapped_from_the_prefix_cache_and_changes_no_bits():
    model = StubModel()
    g = random.Random(5)
    system = [g.randrange(VOCAB) for _ in range(2 * KEY_TILE + 10)]
    reqs = [Request(tuple(system + [g.randrange(VOCAB) for _ in range(n)]), max_tokens=6, label=f"s{n}")
            for n in (3, 20, 9)]
    results, _, _ = run(model, reqs, **ARMS["prefix"])
    assert bits(results) == alone(model, reqs) and sum(r.reused for r in results) >= 2 * KEY_TILE


@pytest.mark.parametrize("arm", ["together", "preempted"])
def test_guesses_kept_and_refused_change_no_bits(arm):
    """A drafter whose guesses are the reply alone, wrong at every fourth position: some verifies keep every guess,
    others stop at the wrong one. Every reply equals its run alone; and what the streams kept is what the rule of
    acceptance says of each proposal against the reply alone (preempted: a dry pool drops some guesses unverified)."""
    model = StubModel()
    reqs = requests()
    want = alone(model, reqs)
    truth = {r.label: ids for r, (ids, _) in zip(reqs, want)}
    guesser = Guesser(truth)
    results, forwards, engine = run(model, reqs, drafter=guesser, **ARMS[arm])
    assert bits(results) == want
    kept = [accepted(g, truth[label][at:]) for label, at, g in guesser.proposals]
    assert any(0 < k == len(g) for k, (_, _, g) in zip(kept, guesser.proposals))  # every guess kept
    assert any(k < len(g) for k, (_, _, g) in zip(kept, guesser.proposals))  # stopped at a wrong guess
    assert sum(r.proposed for r in results) == sum(len(g) for _, _, g in guesser.proposals)
    assert any(guesses for forward in forwards for _, _, _, guesses in forward)
    if arm == "together":  # every proposal verified: the streams kept what the rule says
        assert sum(r.accepted for r in results) == sum(kept)
    else:
        assert engine.scheduler.preemptions > 0 and 0 < sum(r.accepted for r in results) <= sum(kept)


def test_the_stub_reads_what_the_cache_holds():
    """The stub's own control: a row whose cache row was never written (zeros) hashes otherwise than the row
    fed, so a booking that skips a row would show."""
    model = StubModel()
    a, b = model._row(torch.tensor([[3.0, 1.0]]).numpy().tobytes()), model._row(torch.zeros(1, 2).numpy().tobytes())
    assert not torch.equal(a, b)


def test_a_few_rows_and_many_get_the_same_store_rows():
    """KVCache.rows makes a decode step's few rows (8 at most) with Python's integers and a prompt's many with
    tensors: the same store rows for every start and count, on pages (crossing pages) and in a lane. The control:
    a placement whose pages are reordered gives other rows."""
    from tfq.engine.cache import CacheSpec, KVCache

    cache = KVCache(StubModel().config, CacheSpec(lanes=1, window=256, page_rows=16, pool_pages=12))
    paged, lane = cache.pages.paged(), cache.pages.lane(0)
    assert cache.pages.grow(paged, 120) and cache.pages.grow(lane, 120)
    for p in (paged, lane):
        for start in range(0, 90, 7):
            for count in range(1, 9):
                by_tensors = cache.rows(p, start, count + 9)[:count]  # more than 8 rows: the tensor path
                assert torch.equal(cache.rows(p, start, count), by_tensors), (p.paged, start, count)
    before = cache.rows(paged, 10, 8)
    paged.blocks = list(reversed(paged.blocks))
    assert not torch.equal(cache.rows(paged, 10, 8), before)


def tables_of(s) -> list[torch.Tensor]:
    """Every tensor a forward's rows hold (tfq.engine.batch.StepRows), its attention's key tables too."""
    from tfq.kernels.attention import key_tables

    d = s.batch.decode
    return [s.ids, s.positions, s.cache_rows, s.logit_rows, torch.tensor(s.counts), s.segments.table,
            *((d.q_rows, d.cache_rows, d.lengths) if d else ()), *(c.cache_rows for c in s.batch.chunks),
            *key_tables(s.batch, len(s.ids))]


def same_tables(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(tables_of(a), tables_of(b)))


def test_kept_decode_tables_rewritten_in_place_equal_tables_built_anew():
    """The runner's decode tables (DecodeRows), kept from step to step and rewritten in place, equal step_rows'
    built anew at every step: one lane and three, lanes and pages, across key tiles and pages, a lane leaving, a
    page replaced in place, a prompt chunk between. The controls: last step's tables are not this step's, and
    tables that keep what a stream's blocks were (blind to a page replaced) are RED."""
    from tfq.engine.batch import DecodeRows, step_rows
    from tfq.engine.cache import CacheSpec, KVCache

    cache = KVCache(StubModel().config, CacheSpec(lanes=2, window=256, page_rows=64, pool_pages=12))
    lanes = [cache.pages.lane(0), cache.pages.lane(1), cache.pages.paged(slot=2)]
    assert all(cache.pages.grow(p, 256) for p in lanes)

    class Blind(DecodeRows):  # the control: a stream's blocks not among what the kept tables hold
        @staticmethod
        def _holds(f: Feed) -> tuple:
            return f.placement.slot, tile_count(f.start + 1)

    from tfq.kernels.attention import tile_count

    kept, blind, g = DecodeRows(cache), Blind(cache), random.Random(5)
    starts, served, stale_seen, blind_seen = [60, 3, 120], 0, False, False
    for step in range(150):
        who = [0] if step < 40 else [0, 1, 2] if step < 100 or step % 9 == 0 else [2, 0]
        if step == 120:  # a page replaced in place (as copy-on-write of a shared page does)
            lanes[2].blocks[0], lanes[2].blocks[1] = lanes[2].blocks[1], lanes[2].blocks[0]
        chunk = step % 37 == 36  # a prompt chunk between decode steps: built anew
        feeds = [Feed(lanes[i], starts[i], [g.randrange(VOCAB)] * (4 if chunk and i == who[0] else 1)) for i in who]
        before = [t.clone() for t in tables_of(kept.kept)] if kept.kept is not None else None
        got, want = kept.rows(feeds, Arithmetic()), step_rows(cache, feeds, Arithmetic())
        assert same_tables(got, want), step
        served += got is kept.kept and not chunk
        if before is not None and got is kept.kept:  # rewritten in place: last step's values are gone
            stale_seen |= not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(before, tables_of(want)))
        blind_got = blind.rows(feeds, Arithmetic())
        blind_seen |= not same_tables(blind_got, want)
        for i in who:
            starts[i] += len(feeds[who.index(i)].tokens)
    assert served > 100 and stale_seen and blind_seen  # mostly kept; both controls RED
