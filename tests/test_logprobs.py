"""Log-probabilities and the Python API: the scores the server returns are functions of a row's bits, the same
alone or together, chunked or not, preempted or not (at any thread count, and the sampler without a model:
tests/unit/test_logprobs.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engines import alone, engine, run
from tfq.engine.core import Engine
from tfq.engine.stream import Request

TINY_PLAN = str(Path(__file__).parent.parent / "plans" / "tiny.yaml")


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
    alone_runs = alone(model, requests)
    together = run(model, requests, lanes=4, prefill_chunk=16, page_rows=64, paged_all=True, pool_pages=5,
                   page_order_seed=1)
    assert sum(r.preempted for r in together) > 0
    assert scores(together) == scores(alone_runs)
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
    e = engine(loaded.model, tokenizer=loaded.tokenizer)
    prompt = tuple(loaded.tokenizer.encode("def fibonacci(n):"))
    return e, prompt, e.generate([Request(prompt, max_tokens=24)])[0]


def test_streamed_pieces_join_to_the_reply_with_a_stop_string(tiny_models):
    """Text that may begin a stop string is held back, so a streamed reply never shows a stop's first half."""
    e, prompt, free = free_reply(tiny_models)
    stop = free.text[5:9]  # four characters from inside the free reply: the stopped reply ends before them
    pieces: list[str] = []
    stopped = e.generate([Request(prompt, max_tokens=24, stop=(stop,))],
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
    cold_run = run(model, [scored])[0]
    warmed = engine(model, lanes=2, page_rows=64, paged_all=True, pool_pages=16, prefix_cache=True)
    warm = Request(prompt, max_tokens=6)
    first = warmed.generate([warm])[0]
    drawing, *scoring = warmed.generate([warm, scored, scored])
    assert first.reused == 0 and drawing.reused == 3 * 64
    assert all(r.reused == 0 for r in scoring)
    assert scores(scoring) == scores([cold_run, cold_run])
    assert all(all(s is not None for s in r.prompt_logprobs[1:]) for r in scoring)


def forwards_logits_rows(e: Engine) -> list[int]:
    """Record the logits rows of every forward the engine runs."""
    seen: list[int] = []
    real = e.runner.run

    def counting(feeds):
        seen.append(sum(f.logits for f in feeds))
        return real(feeds)

    e.runner.run = counting
    return seen


def test_scored_prompts_take_their_logits_rows_in_chunks_within_the_bound(model):
    """Two streams scoring 150-token prompts beside a decoding one, under logits_rows 24: no forward holds more
    than 24 logits rows, and every score and digest is the run alone's. The control, unbounded, holds more."""
    g = torch.Generator().manual_seed(8)
    requests = [Request(tuple(torch.randint(0, 500, (n,), generator=g).tolist()), max_tokens=12, prompt_logprobs=1,
                        logprobs=0) for n in (150, 150)] + [Request((1, 2, 3), max_tokens=40, logprobs=0)]
    alone_runs = alone(model, requests)
    for bound, within in ((24, True), (0, False)):
        e = engine(model, lanes=3, prefill_chunk=128, logits_rows=bound or 10_000)
        seen = forwards_logits_rows(e)
        together = e.generate(requests)
        assert (max(seen) <= 24) is within, (bound, max(seen))
        assert [r.digests for r in together] == [r.digests for r in alone_runs]
        assert scores(together[:2]) == scores(alone_runs[:2])


def test_logits_rows_below_every_lane_drawing_is_refused(model):
    from tfq.errors import TfqError

    with pytest.raises(TfqError, match=r"logits_rows 3 is fewer than the rows every lane draws from at once \(4 lanes"):
        engine(model, lanes=4, logits_rows=3)


def test_the_stop_that_begins_first_in_the_text_wins(tiny_models):
    """With several stop strings the reply ends before the earliest in its text, whatever the list's order."""
    e, prompt, free = free_reply(tiny_models)
    early, late = free.text[2:5], free.text[9:13]
    assert early not in free.text[:2] and late not in free.text[:9]
    stopped = e.generate([Request(prompt, max_tokens=24, stop=(late, early))])[0]
    assert stopped.finish == "stop" and stopped.text == free.text[:2]
