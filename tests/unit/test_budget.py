"""One forward's budget alone (tfq/engine/budget.py): each of its bounds (rows, learned time, logits rows) binds
on its own, each beside its control (the same streams without that bound take what they ask)."""
from __future__ import annotations

from tfq.engine.budget import Budget
from tfq.engine.step_cost import StepCost, Work, chunk_work
from tfq.engine.stream import Request, Stream

LINE = (0.02, 0.004, 2e-6)  # seconds a step: a + b * rows + c * keys (a made-up machine)


def seconds(work: Work) -> float:
    return LINE[0] + LINE[1] * work.rows + LINE[2] * work.keys


def learned() -> StepCost:
    cost = StepCost()
    for rows, start in [(1, 10), (4, 100), (8, 500), (32, 0), (64, 200), (2, 1000), (16, 50), (128, 300), (3, 3000)]:
        cost.observe(chunk_work(start, rows), seconds(chunk_work(start, rows)))
    assert cost.ready
    return cost


def prompt(id_: int, tokens: int = 300, cached: int = 0, scoring: bool = False) -> Stream:
    """A stream with `cached` rows of its prompt of `tokens` in the cache (order: its id)."""
    st = Stream(id_, Request(tuple(range(1, tokens + 1)), prompt_logprobs=0 if scoring else None),
                list(range(1, tokens + 1)), order=id_, cached=cached)
    return st


def decoding(id_: int, guesses: list[int] = (), cached: int = 40) -> Stream:
    """A stream past its prompt: its last drawn token to feed, and guesses after it."""
    st = Stream(id_, Request(tuple(range(1, cached + 1))), list(range(1, cached + 2)), order=id_, cached=cached)
    st.guesses = list(guesses)
    return st


def takes(budget: Budget, streams: list[Stream], rows: int = 64) -> list[int]:
    """Rows granted, oldest first (a decode asks for its one row)."""
    return [budget.take(st, min(st.pending, rows)) for st in streams]


def test_the_rows_bound_leaves_prompts_what_the_decodes_leave():
    a, b, c = decoding(0, guesses=[5, 6]), prompt(1), prompt(2)
    assert takes(Budget.of([a, b, c], StepCost(), step_tokens=10), [a, b, c]) == [1, 7, 0]  # 10 - (1 + 2 guesses)
    assert takes(Budget.of([a, b, c], StepCost()), [a, b, c]) == [1, 64, 64]  # control: no bound


def test_a_decode_is_never_cut():
    a, b = decoding(0, guesses=[5, 6, 8]), decoding(1, guesses=[5])
    assert takes(Budget.of([a, b], StepCost(), step_tokens=2), [a, b]) == [1, 1]


def test_the_rows_bound_holds_with_nothing_decoding_until_the_cost_is_learned():
    b, c = prompt(1), prompt(2)
    assert takes(Budget.of([b, c], StepCost(), step_tokens=10), [b, c]) == [10, 0]
    assert takes(Budget.of([b, c], learned(), step_tokens=10), [b, c]) == [64, 64]  # learned: whole chunks


def most_rows(bound: float, work: Work, start: int, most: int) -> int:
    """The reference: rows at `start`, counted up one by one, while the forward stays within `bound`."""
    n = 0
    while n < most and seconds(work + chunk_work(start, n + 1)) <= bound:
        n += 1
    return n


def test_the_time_bound_gives_each_prompt_the_rows_that_keep_the_step_within_its_decode_steps():
    """step_steps 4: the forward may last 4 steps of the decodes and a row of each prompt where it stands; the
    oldest prompt takes the most rows that fit, the next what the oldest left. The control, the rows bound alone
    (the same step_tokens), grants other counts."""
    a, b, c = decoding(0, cached=500), prompt(1, 3000, cached=700), prompt(2, 3000, cached=100)
    decodes = chunk_work(a.cached, 1)
    bound = 4 * seconds(decodes + chunk_work(b.cached, 1) + chunk_work(c.cached, 1))
    first = most_rows(bound, decodes, b.cached, 512)
    second = most_rows(bound, decodes + chunk_work(b.cached, first), c.cached, 512)
    timed = takes(Budget.of([a, b, c], learned(), step_tokens=40, step_steps=4), [a, b, c], rows=512)
    assert timed == [1, first, second] and 0 < first < 512 and 0 < second
    assert takes(Budget.of([a, b, c], learned(), step_tokens=40), [a, b, c], rows=512) == [1, 39, 0] != timed


def test_the_time_bound_waits_for_the_cost_to_be_learned():
    a, b = decoding(0), prompt(1)
    assert takes(Budget.of([a, b], StepCost(), step_tokens=40, step_steps=3), [a, b]) == [1, 39]


def test_the_logits_bound_leaves_a_scoring_prompt_what_the_drawing_rows_leave():
    """logits_rows 20: a decode with two guesses draws from 3 rows, a stream not scoring its prompt from 1 (its
    last row, counted whether it reaches it or not); the scoring prompt, oldest first, takes the 16 left, less
    its own guesses, and the next scoring prompt none. The control: the same prompts not scoring take 64 each."""
    a, b, c, d = decoding(0, guesses=[5, 6]), prompt(1), prompt(2, scoring=True), prompt(3, scoring=True)
    assert takes(Budget.of([a, b, c, d], StepCost(), logits_rows=20), [a, b, c, d]) == [1, 64, 16, 0]
    a, b, c, d = decoding(0, guesses=[5, 6]), prompt(1), prompt(2), prompt(3)
    assert takes(Budget.of([a, b, c, d], StepCost(), logits_rows=20), [a, b, c, d]) == [1, 64, 64, 64]


def test_the_bounds_together_grant_the_least():
    b, c = prompt(1, scoring=True), prompt(2)
    budget = Budget.of([decoding(0), b, c], StepCost(), step_tokens=30, logits_rows=12)
    assert budget.take(b, 64) == 10 and budget.take(c, 64) == 19  # logits: 12 - 2 drawing; rows: 29 - 10
