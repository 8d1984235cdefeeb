"""The scheduler alone, without a model: which rows each stream feeds a step, and what its update books. Streams
advance as the engine advances them (`advance`: a stream at the end of its rows draws, then `Scheduler.update`)."""
from __future__ import annotations

import pytest

from tfq.engine.draft import accepted
from tfq.engine.pages import PagePool
from tfq.engine.prefix import PrefixCache, root_key
from tfq.engine.scheduler import Scheduler
from tfq.engine.settings import EngineSettings
from tfq.engine.step_cost import StepCost, Work, chunk_work
from tfq.engine.stream import Request, Status, Stream


def scheduler(lanes: int = 4, prefill_chunk: int = 64, step_tokens: int = 0, window: int = 1024,
              page_rows: int = 0, pool_pages: int = 0, prefix: bool = False, step_steps: int = 0) -> Scheduler:
    """Contiguous lanes; with page_rows, every lane paged from a pool (by default one that holds every lane's
    window), and a prefix cache if asked."""
    pool_pages = pool_pages or (lanes * window // page_rows if page_rows else 0)
    settings = EngineSettings(window=window, lanes=lanes, prefill_chunk=prefill_chunk, page_rows=page_rows,
                              paged_all=True, pool_pages=pool_pages, step_tokens=step_tokens, step_steps=step_steps)
    pool = PagePool(settings.contiguous_lanes, window, page_rows, pool_pages,
                    prefix=PrefixCache(root_key("test")) if prefix else None)
    return Scheduler(settings, pool)


def add(s: Scheduler, prompt: int | list[int], index: int, max_tokens: int = 100) -> Stream:
    """A stream of `prompt` tokens (1, 2, ...), or of the tokens given."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    st = Stream(index, Request(prompt=tuple(tokens), max_tokens=max_tokens), list(tokens))
    s.add(st)
    return st


def draw(s: Scheduler, step, draws: dict[int, list[int]] | None = None) -> list[int]:
    """As the engine draws: a stream at the end of its rows draws token 7 (or draws[its id]) while it has not
    finished and its draws confirm its guesses (tfq.engine.draft.accepted). Tokens drawn, stream by stream."""
    drawn = []
    for st, feed in ((x.stream, x.feed) for x in step.scheduled):
        tokens: list[int] = []
        if feed.start + feed.chunk == len(st.tokens) and st.finish is None:
            for token in (draws or {}).get(st.id, [7]):
                st.append(token, frozenset(), s.settings.window)
                tokens.append(token)
                if st.finish is not None or accepted(feed.tokens[feed.chunk:], tokens) < len(tokens):
                    break
        drawn.append(len(tokens))
    return drawn


def advance(s: Scheduler, step) -> dict[int, int]:
    """Draw, then the scheduler's update; rows fed, by stream."""
    s.update(step, draw(s, step))
    return {x.stream.id: len(x.feed.tokens) for x in step.scheduled}


def test_without_a_budget_a_prompt_goes_in_whole_chunks_beside_decodes():
    s = scheduler(prefill_chunk=64)
    add(s, 10, 0)
    advance(s, s.schedule())  # stream 0's prompt: it now decodes
    add(s, 300, 1)
    assert advance(s, s.schedule()) == {0: 1, 1: 64}


def test_a_budget_cuts_prompt_chunks_while_a_stream_decodes():
    """Decodes first, whole; prompt chunks, oldest first, share what the budget leaves. With nothing decoding,
    the budget holds too until the cost of steps is learned (the watchdog's bound follows that cost: a first step
    of a large model cannot run long unbounded); once learned, whole chunks."""
    s = scheduler(lanes=4, prefill_chunk=64, step_tokens=20)
    a, b = add(s, 10, 0), add(s, 5, 1)
    assert advance(s, s.schedule()) == {0: 10, 1: 5}  # nobody decodes yet: within the budget
    add(s, 300, 2), add(s, 300, 3)
    assert advance(s, s.schedule()) == {0: 1, 1: 1, 2: 18}  # 2 decodes, then 18 rows to the oldest prompt (3 waits)
    assert advance(s, s.schedule()) == {0: 1, 1: 1, 2: 18}
    a.finish = b.finish = "length"
    s.finish(a), s.finish(b)
    assert advance(s, s.schedule()) == {2: 20}  # no decodes, the cost not learned: the budget still
    teach(s.cost)
    assert advance(s, s.schedule()) == {2: 64, 3: 64}  # no decodes, the cost learned: whole chunks


def test_a_budget_never_cuts_a_decode_and_every_prompt_finishes():
    s = scheduler(lanes=4, prefill_chunk=64, step_tokens=4)
    streams = [add(s, n, i) for i, n in enumerate((3, 2, 200, 90))]
    fed = {i: 0 for i in range(4)}
    for _ in range(200):
        step = s.schedule()
        decodes = sum(1 for st in step.streams if st.pending == 1)
        rows = advance(s, step)
        if decodes:
            assert sum(rows.values()) <= 4
        for i, n in rows.items():
            fed[i] += n
        if all(st.cached >= len(st.request.prompt) for st in streams):
            break
    assert all(st.cached >= len(st.request.prompt) for st in streams)  # progress: every prompt went in


@pytest.mark.parametrize("budget, lanes", [(3, 4), (0, 4)])
def test_the_plan_refuses_a_budget_below_every_lane_decoding(budget, lanes):
    from tfq.errors import TfqError
    from tfq.plan.layout import step_tokens
    from tfq.plan.schema import Plan

    plan = Plan(lanes=lanes, step_tokens=budget or "auto")
    if budget:
        with pytest.raises(TfqError, match="step_tokens 3 is fewer than the rows every lane decodes at once"):
            step_tokens(plan, "cpu")
    else:
        assert step_tokens(plan, "cpu") == lanes + 32 and step_tokens(plan, "cuda:0") == lanes * plan.prefill_chunk


LINE = (0.02, 0.004, 2e-6)  # seconds a step: a + b * rows + c * keys (a made-up machine)


def line_seconds(work: Work, line=LINE) -> float:
    a, b, c = line
    return a + b * work.rows + c * work.keys


def teach(cost: StepCost, line=LINE) -> None:
    """Steps of varied work, each taking what the line says: the fit has seen every term vary."""
    for rows, start in [(1, 10), (4, 100), (8, 500), (32, 0), (64, 200), (2, 1000), (16, 50), (128, 300), (3, 3000)]:
        cost.observe(chunk_work(start, rows), line_seconds(chunk_work(start, rows), line))


def test_the_cost_of_steps_is_learned_from_the_steps_seen():
    """Not a bit depends on it (it only sizes prompt chunks), so a float tolerance: the fit predicts work it never
    saw, and follows the machine when its steps slow down."""
    cost = StepCost()
    teach(cost)
    assert cost.ready
    for work in (chunk_work(700, 40), chunk_work(0, 512), Work(8, 8 * 900)):
        assert cost.seconds(work) == pytest.approx(line_seconds(work), rel=1e-6)
    slower = tuple(2 * x for x in LINE)
    for _ in range(40):
        teach(cost, slower)
    assert cost.seconds(chunk_work(700, 40)) == pytest.approx(line_seconds(chunk_work(700, 40), slower), rel=0.05)


def most_rows_in(seconds: float, work: Work, start: int, most: int) -> int:
    """The reference: the most rows at `start`, counted up one by one, that keep the step within `seconds`."""
    n = 0
    while n < most and line_seconds(work + chunk_work(start, n + 1)) <= seconds:
        n += 1
    return n


def test_a_timed_budget_gives_a_prompt_the_rows_that_keep_the_step_within_three_decode_steps():
    """Once the cost is learned, a prompt beside decodes takes the rows whose step the cost puts within
    step_steps decode steps of every running stream; further into its prompt (more keys a row) it takes fewer.
    Before, the rows of step_tokens bound it; the control, the rows bound alone, gives another count."""
    s = scheduler(lanes=4, prefill_chunk=512, step_tokens=40, step_steps=3, window=4096)
    a, b = decoding(s, prompt=10, index=0), decoding(s, prompt=20, index=1)
    long = add(s, 3000, 2)
    assert advance(s, s.schedule()) == {0: 1, 1: 1, 2: 38}  # not learned yet: the rows bound
    teach(s.cost)
    decodes = chunk_work(a.cached, 1) + chunk_work(b.cached, 1)
    bound = 3 * line_seconds(decodes + chunk_work(long.cached, 1))
    want = most_rows_in(bound, decodes, long.cached, 512)
    assert advance(s, s.schedule()) == {0: 1, 1: 1, 2: want} and 0 < want < 38
    for _ in range(20):  # deeper into the prompt
        advance(s, s.schedule())
    decodes = chunk_work(a.cached, 1) + chunk_work(b.cached, 1)
    later = most_rows_in(3 * line_seconds(decodes + chunk_work(long.cached, 1)), decodes, long.cached, 512)
    assert advance(s, s.schedule())[2] == later < want
    rows_only = scheduler(lanes=4, prefill_chunk=512, step_tokens=40, window=4096)  # the control
    decoding(rows_only, prompt=10, index=0), decoding(rows_only, prompt=20, index=1), add(rows_only, 3000, 2)
    teach(rows_only.cost)
    assert advance(rows_only, rows_only.schedule())[2] == 38 != want


@pytest.mark.parametrize("guesses", [[], [5, 6, 8]])
@pytest.mark.parametrize("line", [LINE, (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)])
def test_a_timed_budget_of_one_decode_step_still_moves_every_prompt(line, guesses):
    """The tightest bound (one decode step of the running streams, a verify for a stream that guesses) still
    leaves each prompt a row a step, deep into its prompt or not, whatever the terms of the cost: every prompt
    goes on."""
    s = scheduler(lanes=4, prefill_chunk=512, step_tokens=40, step_steps=1, window=4096)
    decoding(s, prompt=10, index=0)
    add(s, 300, 1), add(s, 2000, 2)
    teach(s.cost, line)
    for _ in range(5):
        rows = advance(s, s.schedule({0: guesses}))
        assert rows[0] == 1 + len(guesses) and rows[1] >= 1 and rows[2] >= 1


def decoding(s: Scheduler, prompt: int = 10, index: int = 0, max_tokens: int = 100) -> Stream:
    """A stream past its prompt: it feeds one row a step (plus its guesses)."""
    st = add(s, prompt, index, max_tokens)
    advance(s, s.schedule())
    assert st.pending == 1
    return st


@pytest.mark.parametrize("draws, kept", [([5, 6, 9], 3), ([5, 6, 8, 4], 4), ([2], 1)])
def test_update_keeps_the_confirmed_guesses_and_gives_back_the_rest(draws, kept):
    """A verify of guesses 5 6 8: its rows up to the last draw stand (cached), the draws that matched count as
    accepted, the rest of its pages go back, and a verify that kept fewer rows than it fed is returned for the
    hybrid's roll-back."""
    s = scheduler(lanes=1, window=64, page_rows=4)
    st = decoding(s, prompt=10)
    start = st.cached
    step = s.schedule({0: [5, 6, 8]})
    assert step.feeds[0].tokens == [7, 5, 6, 8] and step.feeds[0].guesses == 3 and st.proposed == 3
    assert len(st.placement.pages) == 4  # rows 0..13
    verified = s.update(step, draw(s, step, {0: draws}))
    assert st.cached == start + kept and st.accepted == kept - 1 and st.verifies == 1
    assert len(st.placement.pages) == -(-st.cached // 4)  # rejected rows gave their pages back
    assert [(v.stream, v.kept, v.rows) for v in verified] == ([(st, kept, 4)] if kept < 4 else [])


def test_update_finishes_streams_and_forgets_their_roll_back():
    """A stream whose draw ends it (its token budget here) is finished by the update: lane and pages back, and
    no roll-back of a state nobody holds any more; one that failed drawing is finished with its rows untouched."""
    s = scheduler(lanes=2, window=64, page_rows=4)
    a = decoding(s, prompt=10, index=0, max_tokens=2)
    b = decoding(s, prompt=10, index=1)
    held = s.pages.available
    step = s.schedule({0: [5, 6], 1: [5]})
    b.fail("the stream failed while drawing its token: boom", fault=True)
    verified = s.update(step, draw(s, step, {0: [5, 9], 1: []}))
    assert a.finish == "length" and a.status is Status.FINISHED and b.status is Status.FINISHED
    assert verified == [] and s.running() == [] and s.pages.available > held
    assert b.cached == 10  # the failed stream's rows were not booked


def test_guesses_only_for_decoding_streams_within_their_budgets():
    s = scheduler(lanes=3, window=20)
    a = decoding(s, prompt=10, index=0, max_tokens=4)  # two drawn (the second beside b's prompt): one guess left
    b = decoding(s, prompt=17, index=1)  # 18 tokens of a 20-row window
    c = add(s, 10, 2)  # not admitted yet
    streams, budgets = s.guess_budgets(4)
    assert streams == [a, b] and budgets == [1, 2]
    step = s.schedule({0: [5], 1: [5, 6], 2: [5]})  # c is admitted with its prompt to feed: no guesses
    assert [f.guesses for f in step.feeds] == [1, 2, 0] and c.guesses == []


def test_a_prompt_longer_than_the_window_finishes_at_once():
    s = scheduler(lanes=1, window=16)
    st = add(s, 16, 0)
    assert st.status is Status.FINISHED and st.finish == "error" and "window of 16 rows" in st.error
    assert not s.has_work()


def test_admission_is_oldest_first_into_free_lanes():
    s = scheduler(lanes=2)
    a, b, c = (add(s, 5, i) for i in range(3))
    assert advance(s, s.schedule()) == {0: 5, 1: 5} and c.status is Status.WAITING
    a.finish = "stop"
    s.finish(a)
    step = s.schedule()
    assert c.lane == 0 and [st.id for st in step.streams] == [1, 2]  # oldest first: b (admitted before) then c
    assert s.stats().running == 2 and s.stats().waiting == 0


def test_a_dry_pool_drops_guesses_first_then_preempts_the_newest():
    """A pool of 6 pages of 4 rows, two streams of 10 tokens (3 pages each): the oldest's guesses go first;
    when it needs a fourth page, the newest stream is preempted (back to the front of the queue, its cache to
    recompute), and the oldest runs on."""
    s = scheduler(lanes=2, window=64, page_rows=4, pool_pages=6)
    a, b = add(s, 10, 0), add(s, 10, 1)
    advance(s, s.schedule())
    step = s.schedule({0: [5, 5]})  # 13 rows would take a fourth page: the guesses are dropped
    assert a.guesses == [] and a.proposed == 2 and step.feeds[0].guesses == 0 and s.preemptions == 0
    advance(s, step)
    advance(s, s.schedule())  # a: 12 rows, still 3 pages
    step = s.schedule()  # a needs 13 rows: b, the newest holding pages, is preempted
    assert [st.id for st in step.streams] == [0] and s.stats().preemptions == 1
    assert b.status is Status.WAITING and b.cached == 0 and b.recomputed == 1 and list(s.waiting) == [b]


def test_a_stream_maps_the_full_pages_another_computed():
    """With a prefix cache, the full pages a finished stream's prompt filled are found again by their tokens:
    a stream whose prompt starts with them begins with those rows cached (never its last token's page)."""
    s = scheduler(lanes=2, window=64, page_rows=4, prefix=True)
    shared = list(range(100, 112))  # three full pages
    a = add(s, shared + [1, 2, 3], 0)
    advance(s, s.schedule())
    a.finish = "stop"
    s.finish(a)
    assert s.stats().cached_pages == 3  # no stream holds them; the cache keeps them
    b = add(s, shared + [7], 1)
    step = s.schedule()
    assert b.cached == 12 and b.reused == 12 and step.feeds[0].start == 12 and step.feeds[0].tokens == [7]
    assert s.stats().reused_rows == 12 and s.stats().cached_pages == 0
    c = add(s, shared[:8] + [9, 9, 9, 9, 9], 2)  # shares two pages only
    s.schedule()
    assert c.cached == 8


def test_a_dry_pool_preempts_a_newer_stream_the_budget_left_out_of_the_step():
    """The step budget can leave a prompt out of a forward while it holds pages: when the pool runs dry, that
    stream is the newest holder and is preempted; the decoding stream runs on (it was once failed instead, as
    if nobody else held a page)."""
    s = scheduler(lanes=2, window=64, page_rows=4, pool_pages=6, prefill_chunk=12, step_tokens=1)
    teach(s.cost)  # learned: a step without decodes takes whole chunks
    a, b = add(s, 10, 0), add(s, 20, 1)
    assert advance(s, s.schedule()) == {0: 10, 1: 12}  # 3 pages each: the pool is full
    for _ in range(2):
        assert advance(s, s.schedule()) == {0: 1}  # a decodes; the budget leaves b out (it holds its pages)
    step = s.schedule()  # a needs a fourth page
    assert [st.id for st in step.streams] == [0] and a.finish is None and step.failed == []
    assert b.status is Status.WAITING and b.preempted == 1
