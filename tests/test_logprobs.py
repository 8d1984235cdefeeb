"""Log-probabilities and the Python API: the scores the server returns are functions of a row's bits, the same
alone or together, chunked or not, preempted or not, at any thread count."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hst

from tfq.engine import Controls, Engine, EngineSettings
from tfq.sampling import choice_seed, log_softmax, logprob
from tfq.stream import Request, held_back

TINY_PLAN = str(Path(__file__).parent.parent / "plans" / "tiny.yaml")


def test_logprob_is_the_log_softmax_in_float64():
    """Within float32's rounding of each token's weight (tfq.sampling.weights) of the exact log-softmax."""
    row = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 4
    want = torch.log_softmax(row.double(), 0)
    got = log_softmax(row)
    assert abs(np.exp(got).sum() - 1) < 1e-7
    assert np.abs(got - want.numpy()).max() < 1e-7  # a value against the math: a bound, not bits
    s = logprob(row, 17, top=5)
    order = torch.argsort(want, descending=True, stable=True)[:5]
    assert [t for t, _ in s.top] == order.tolist() and s.logprob == float(got[17])


def test_top_logprobs_break_ties_by_the_lower_id():
    row = torch.zeros(10)
    row[[7, 3, 5]] = 1.0
    assert [t for t, _ in logprob(row, 0, top=4).top] == [3, 5, 7, 0]


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_logprobs_do_not_move_with_the_thread_count(threads):
    row = torch.randn(151_936, generator=torch.Generator().manual_seed(1)) * 6
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    want = logprob(row, 3, top=20)
    torch.set_num_threads(threads)
    try:
        assert logprob(row, 3, top=20) == want  # floats compared with ==: their bits
    finally:
        torch.set_num_threads(before)


def test_choice_seeds():
    assert choice_seed(5, 0) == 5
    assert len({choice_seed(5, j) for j in range(8)}) == 8 and choice_seed(5, 1) != choice_seed(6, 1)


def test_a_stop_strings_start_is_held_back():
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["qwen2"].model


def scores(results):
    return [([s.logprob for s in r.prompt_logprobs[1:]], [(s.token, s.logprob, s.top) for s in r.logprobs])
            for r in results]


def test_prompt_and_reply_logprobs_equal_alone_chunked_paged_and_preempted(model):
    """Four streams with prompt and reply scores: alone on a whole plan, then together in 16-row chunks on a
    pool small enough to preempt; every score's bits are the same."""
    g = torch.Generator().manual_seed(3)
    requests = [Request(tuple(torch.randint(0, 500, (n,), generator=g).tolist()), max_tokens=24, logprobs=3,
                        prompt_logprobs=2, temperature=t, seed=9)
                for n, t in ((90, 0.0), (40, 0.7), (130, 0.0), (70, 0.9))]
    alone = [Engine(model, EngineSettings(window=512, lanes=1)).generate([r])[0] for r in requests]
    busy = Engine(model, EngineSettings(window=512, lanes=4, prefill_chunk=16, page_rows=64, paged_all=True,
                                        pool_pages=5), controls=Controls(page_order_seed=1))
    together = busy.generate(requests)
    assert sum(r.preempted for r in together) > 0
    assert scores(together) == scores(alone)
    assert all(len(r.prompt_logprobs) == len(q.prompt) and r.prompt_logprobs[0] is None
               for r, q in zip(together, requests))


def test_the_python_api(tiny_dirs):
    from tfq import LLM, SamplingParams

    llm = LLM(model=str(tiny_dirs["qwen2"]), plan=TINY_PLAN)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=2, logprobs=2, prompt_logprobs=1)
    prompts = ["def fibonacci(n):", "hello there", [5, 6, 7, 8]]
    together = llm.generate(prompts, params)
    assert [len(o.outputs) for o in together] == [2, 2, 2]
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
        assert [c.digests for c in out.outputs] == [c.digests for c in alone.outputs]
        assert [c.logprobs for c in out.outputs] == [c.logprobs for c in alone.outputs]
        assert out.prompt_logprobs == alone.prompt_logprobs and out.prompt_logprobs[0] is None
        assert all(len(c.logprobs) == len(c.token_ids) and math.isfinite(c.logprobs[0].logprob)
                   for c in out.outputs)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    assert chat[0].prompt.startswith("<|im_start|>") and len(chat[0].outputs[0].token_ids) == 4


def free_reply(tiny_models):
    """(engine, prompt, result): the tiny model's greedy 24-token reply to a short prompt, with no stop string."""
    loaded = tiny_models["qwen2"]
    engine = Engine(loaded.model, EngineSettings(window=512, lanes=1), loaded.tokenizer)
    prompt = tuple(loaded.tokenizer.encode("def fibonacci(n):"))
    return engine, prompt, engine.generate([Request(prompt, max_tokens=24)])[0]


def test_streamed_pieces_join_to_the_reply_with_a_stop_string(tiny_models):
    """Text that may begin a stop string is held back, so a streamed reply never shows a stop's first half."""
    engine, prompt, free = free_reply(tiny_models)
    stop = free.text[5:9]  # four characters from inside the free reply: the stopped reply ends before them
    pieces: list[str] = []
    stopped = engine.generate([Request(prompt, max_tokens=24, stop=(stop,))],
                              on_token=lambda _, __, piece: pieces.append(piece))[0]
    assert stopped.finish == "stop" and stopped.text == free.text[:free.text.index(stop)]
    assert "".join(pieces) == stopped.text


def test_prompt_scores_from_a_warm_prefix_equal_cold(model):
    """A stream that scores its prompt computes every prompt row, even where the prefix cache holds its pages (a
    mapped page brings keys and values, not the logits that score the next token); its choices (n = 2) too. A
    stream that only draws maps them: the cache was warm, so a scoring stream that mapped would show None."""
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(0, 500, (200,), generator=g).tolist())  # three full 64-row pages
    scored = Request(prompt, max_tokens=6, prompt_logprobs=2, logprobs=1)
    cold_run = Engine(model, EngineSettings(window=512, lanes=1)).generate([scored])[0]
    engine = Engine(model, EngineSettings(window=512, lanes=2, page_rows=64, paged_all=True, pool_pages=16,
                                          prefix_cache=True))
    warm = Request(prompt, max_tokens=6)
    first = engine.generate([warm])[0]
    drawing, *scoring = engine.generate([warm, scored, scored])
    assert first.reused == 0 and drawing.reused == 3 * 64
    assert all(r.reused == 0 for r in scoring)
    assert scores(scoring) == scores([cold_run, cold_run])
    assert all(all(s is not None for s in r.prompt_logprobs[1:]) for r in scoring)


def forwards_logits_rows(engine: Engine) -> list[int]:
    """Record the logits rows of every forward the engine runs."""
    seen: list[int] = []
    run = engine.runner.run

    def counting(feeds):
        seen.append(sum(f.logits for f in feeds))
        return run(feeds)

    engine.runner.run = counting
    return seen


def test_scored_prompts_take_their_logits_rows_in_chunks_within_the_bound(model):
    """Two streams scoring 150-token prompts beside a decoding one, under logits_rows 24: no forward holds more
    than 24 logits rows, and every score and digest is the run alone's. The control, unbounded, holds more."""
    g = torch.Generator().manual_seed(8)
    requests = [Request(tuple(torch.randint(0, 500, (n,), generator=g).tolist()), max_tokens=12, prompt_logprobs=1,
                        logprobs=0) for n in (150, 150)] + [Request((1, 2, 3), max_tokens=40, logprobs=0)]
    alone = [Engine(model, EngineSettings(window=512, lanes=1)).generate([r])[0] for r in requests]
    for bound, within in ((24, True), (0, False)):
        engine = Engine(model, EngineSettings(window=512, lanes=3, prefill_chunk=128, logits_rows=bound or 10_000))
        seen = forwards_logits_rows(engine)
        together = engine.generate(requests)
        assert (max(seen) <= 24) is within, (bound, max(seen))
        assert [r.digests for r in together] == [r.digests for r in alone]
        assert scores(together[:2]) == scores(alone[:2])


def test_logits_rows_below_every_lane_drawing_is_refused(model):
    from tfq.errors import TfqError

    with pytest.raises(TfqError, match=r"logits_rows 3 is fewer than the rows every lane draws from at once \(4 lanes"):
        Engine(model, EngineSettings(window=512, lanes=4, logits_rows=3))


def test_the_stop_that_begins_first_in_the_text_wins(tiny_models):
    """With several stop strings the reply ends before the earliest in its text, whatever the list's order."""
    engine, prompt, free = free_reply(tiny_models)
    early, late = free.text[2:5], free.text[9:13]
    assert early not in free.text[:2] and late not in free.text[:9]
    stopped = engine.generate([Request(prompt, max_tokens=24, stop=(late, early))])[0]
    assert stopped.finish == "stop" and stopped.text == free.text[:2]


@given(text=hst.text("ab", max_size=14), stops=hst.lists(hst.text("ab", min_size=1, max_size=9), min_size=1,
                                                          max_size=4))
def test_held_back_is_the_longest_end_that_begins_a_stop(text, stops):
    want = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    assert held_back(text, tuple(stops)) == want


def test_a_tiny_temperature_draws_the_most_likely_token_not_nan():
    """logits / 1e-40 overflows fp32; scaled from the row's max instead, the draw is the argmax (before: the
    probabilities were NaN and the draw the last id)."""
    from tfq.sampling import sample

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    logits[7] = 12.0
    assert [sample(logits, t, 1.0, s, 3) for t in (1e-40, 1e-38, 1e-30) for s in (0, 1)] == [7] * 6
    assert not torch.isfinite(logits / 1e-40).all()  # the case is the overflow, by construction


def whole_order_draw(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int,
                     higher_id_first: bool = False) -> int:
    """The sampler's recipe spelled out: every token sorted (by weight, then by id), the running sums of all of
    them, top-p's head, the keyed draw. higher_id_first breaks ties the other way (the control)."""
    from tfq.sampling import draw_key, weights

    w = weights(logits / temperature)[1]
    ids = np.arange(len(w))[::-1] if higher_id_first else np.arange(len(w))
    order = ids[np.argsort(-w[ids], kind="stable")]
    cum = np.cumsum(w[order], dtype=np.float64)
    keep = int(np.searchsorted(cum, top_p * cum[-1])) + 1 if top_p < 1.0 else len(cum)
    r = torch.rand(1, generator=torch.Generator().manual_seed(draw_key(seed, position)), dtype=torch.float64).item()
    return int(order[min(int(np.searchsorted(cum[:keep], r * cum[keep - 1], side="right")), keep - 1)])


def test_the_sampler_sorts_only_the_head_yet_draws_what_the_whole_order_draws():
    """sample() sorts only as many tokens as the draw needs; it draws what sorting all of them draws, on peaked,
    flat and tied rows and at every top_p. The control breaks ties by the higher id: it parts on the tied rows."""
    from tfq.sampling import sample

    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, generator=g) * scale for n in (50, 3000, 151936) for scale in (0.3, 3.0, 12.0)]
    rows += [torch.round(torch.randn(3000, generator=g) * 2) / 2, torch.zeros(600)]  # ties everywhere
    settings = [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (2.0, 0.999), (1.0, 0.02)]
    for seed, row in enumerate(rows):
        for t, p in settings:
            assert sample(row, t, p, seed, 9) == whole_order_draw(row, t, p, seed, 9), (seed, t, p)
    parted = [sample(row, t, p, s, 9) != whole_order_draw(row, t, p, s, 9, higher_id_first=True)
              for row in rows[-2:] for t, p in settings for s in range(4)]
    assert any(parted)  # control
