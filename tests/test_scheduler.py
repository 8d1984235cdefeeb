"""The scheduler alone, without a model: which rows each stream feeds a step. Streams advance as the engine
would advance them (`advance`: a feed's rows are cached, a stream at the end of its rows draws one token)."""
from __future__ import annotations

import pytest
from tfq.pages import PagePool
from tfq.scheduler import Scheduler
from tfq.stream import Request, Stream


def scheduler(lanes: int = 4, prefill_chunk: int = 64, step_tokens: int = 0, window: int = 1024) -> Scheduler:
    return Scheduler(lanes, lanes, prefill_chunk, window, PagePool(lanes, window), step_tokens=step_tokens)


def add(s: Scheduler, prompt: int, index: int, max_tokens: int = 100) -> Stream:
    st = Stream(index, Request(prompt=tuple(range(1, prompt + 1)), max_tokens=max_tokens), list(range(1, prompt + 1)))
    s.add(st)
    return st


def advance(step) -> dict[int, int]:
    """Cache each feed's rows and draw a token where a stream reached the end of its tokens; rows by stream."""
    rows = {}
    for st, feed in zip(step.streams, step.feeds):
        st.cached += len(feed.tokens)
        if st.cached == len(st.tokens):
            st.tokens.append(7)
            st.digests.append("")
        rows[st.index] = len(feed.tokens)
    return rows


def test_without_a_budget_a_prompt_goes_in_whole_chunks_beside_decodes():
    s = scheduler(prefill_chunk=64)
    add(s, 10, 0)
    advance(s.schedule())  # stream 0's prompt: it now decodes
    add(s, 300, 1)
    assert advance(s.schedule()) == {0: 1, 1: 64}


def test_a_budget_cuts_prompt_chunks_while_a_stream_decodes():
    """Decodes first, whole; prompt chunks, oldest first, share what the budget leaves."""
    s = scheduler(lanes=4, prefill_chunk=64, step_tokens=20)
    a, b = add(s, 10, 0), add(s, 5, 1)
    assert advance(s.schedule()) == {0: 10, 1: 5}  # nobody decodes yet: whole chunks
    add(s, 300, 2), add(s, 300, 3)
    assert advance(s.schedule()) == {0: 1, 1: 1, 2: 18}  # 2 decodes, then 18 rows to the oldest prompt (3 waits)
    assert advance(s.schedule()) == {0: 1, 1: 1, 2: 18}
    a.finish = b.finish = "length"
    s.finish(a), s.finish(b)
    assert advance(s.schedule()) == {2: 64, 3: 64}  # no decodes: whole chunks again


def test_a_budget_never_cuts_a_decode_and_every_prompt_finishes():
    s = scheduler(lanes=4, prefill_chunk=64, step_tokens=4)
    streams = [add(s, n, i) for i, n in enumerate((3, 2, 200, 90))]
    fed = {i: 0 for i in range(4)}
    for _ in range(200):
        step = s.schedule()
        decodes = sum(1 for st in step.streams if st.pending == 1)
        rows = advance(step)
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
