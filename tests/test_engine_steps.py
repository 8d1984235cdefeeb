"""The engine driven one step at a time (the server's way): requests join at different steps, one is aborted
mid-reply, and every other stream still equals its run alone; the aborted stream's lane and pages go back."""
from __future__ import annotations

import torch

from engines import run, same
from tfq.engine.core import Controls, Engine, EngineSettings
from tfq.engine.stream import Request, Status
from tfq.kernels.contract import KEY_TILE

WINDOW = 512


def requests(vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(12)
    return [Request(tuple(torch.randint(3, vocab, (n,), generator=g).tolist()), max_tokens=t, label=f"r{i}")
            for i, (n, t) in enumerate([(40, 12), (150, 9), (7, 14), (90, 10), (33, 8)])]


def alone(model, request: Request):
    return run(model, [request], keep_logits=True)[0]


def test_add_step_abort(tiny_models):
    model = tiny_models["qwen3"].model
    reqs = requests(model.config.vocab_size)
    settings = EngineSettings(window=WINDOW, lanes=3, prefill_chunk=29, page_rows=KEY_TILE, paged_all=True,
                              pool_pages=12)
    engine = Engine(model, settings, eos_ids=(), keep_logits=True, controls=Controls(page_order_seed=4))
    pool = len(engine.pages.free)
    ids = {0: engine.add(reqs[0]), 1: engine.add(reqs[1])}
    drawn = {i: 0 for i in range(len(reqs))}
    aborted = None
    steps = 0
    while engine.has_work() or len(ids) < len(reqs):
        steps += 1
        if steps == 3:
            ids[2] = engine.add(reqs[2])  # joins while others are prefilling
        if steps == 9:
            ids[3], ids[4] = engine.add(reqs[3]), engine.add(reqs[4])  # more than the free lanes: they wait
        for out in engine.step():
            i = next(k for k, v in ids.items() if v == out.id)
            drawn[i] += 1
            if i == 1 and drawn[1] == 4 and aborted is None:  # mid-reply
                engine.abort(out.id)
                aborted = out.id
                st = engine.streams[out.id]
                assert st.status is Status.FINISHED and st.placement is None and st.lane is None
    assert aborted is not None
    cut = engine.result(aborted)
    assert cut.finish == "abort" and len(cut.ids) == 4
    assert cut.ids == alone(model, reqs[1]).ids[:4]  # what it drew before the abort was exact too
    for i, req in enumerate(reqs):
        if i != 1:
            got = engine.result(ids[i])
            assert got.finish == "length" and same(got, alone(model, req)), req.label
    assert len(engine.pages.free) == pool and not engine.has_work()
    assert all(lane is None for lane in engine.scheduler.lanes)


def test_abort_a_waiting_stream(tiny_models):
    model = tiny_models["qwen2"].model
    reqs = requests(model.config.vocab_size)
    engine = Engine(model, EngineSettings(window=WINDOW, lanes=1), eos_ids=(), keep_logits=True)
    first, second = engine.add(reqs[0]), engine.add(reqs[2])
    engine.step()
    engine.abort(second)  # never admitted: it leaves the queue
    assert engine.result(second).finish == "abort" and engine.result(second).ids == []
    while engine.has_work():
        engine.step()
    assert same(engine.result(first), alone(model, reqs[0]))


def test_a_preempted_stream_keeps_its_age_and_newer_ones_go_first(tiny_models):
    """Preemption takes the newest stream holding pages; a stream sent back keeps its first admission's order when
    readmitted (made the newest again, a long request would be the next victim every time, and could starve)."""
    model = tiny_models["qwen2"].model
    reqs = requests(model.config.vocab_size)
    engine = Engine(model, EngineSettings(window=WINDOW, lanes=3, prefill_chunk=29, page_rows=KEY_TILE, paged_all=True,
                                          pool_pages=4), eos_ids=(), keep_logits=True)
    victims: list[tuple[int, int]] = []  # (the victim's order, the newest order holding pages then)
    real = engine.scheduler.preempt

    def preempt(st):
        held = [s.order for s in engine.scheduler.running() if s.placement.pages or s is st]  # or it waits
        victims.append((st.order, max(held)))
        real(st)

    engine.scheduler.preempt = preempt
    ids = [engine.add(r) for r in reqs]
    first: dict[int, int] = {}
    back = set()  # streams seen running again after a preemption
    while engine.has_work():
        engine.step()
        for st in engine.scheduler.running():
            assert first.setdefault(st.id, st.order) == st.order
            if st.preempted:
                back.add(st.id)
    assert victims and all(order == newest for order, newest in victims) and back
    for i, req in zip(ids, reqs):
        assert same(engine.result(i), alone(model, req)), req.label


def test_generate_keeps_nothing_of_finished_streams(tiny_models):
    model = tiny_models["qwen2"].model
    engine = Engine(model, EngineSettings(window=WINDOW, lanes=2))
    for _ in range(3):
        engine.generate(requests(model.config.vocab_size)[:2])
    assert engine.streams == {}


def test_a_timed_step_budget_learns_from_every_step_and_changes_no_bits(tiny_models):
    """step_steps: the engine times each step for the scheduler's cost of steps (one observation a forward),
    and every reply under the timed budget (whose chunks follow the clock) equals its request's run alone."""
    model = tiny_models["qwen3"].model
    reqs = requests(model.config.vocab_size)
    engine = Engine(model, EngineSettings(window=WINDOW, lanes=3, prefill_chunk=29, step_tokens=4, step_steps=2),
                    eos_ids=(), keep_logits=True)
    results = engine.generate(reqs)
    assert engine.scheduler.cost.ready and engine.scheduler.cost.seen == engine.forwards
    assert all(same(r, alone(model, q)) for r, q in zip(results, reqs))
