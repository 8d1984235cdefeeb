"""Log-probabilities and the Python API: the scores the server returns are functions of a row's bits, the same
alone or together, chunked or not, preempted or not, at any thread count."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tfq.engine import Engine, EngineSettings
from tfq.sampling import choice_seed, log_softmax, logprob
from tfq.stream import Request, held_back

TINY_PLAN = str(Path(__file__).parent.parent / "plans" / "tiny.yaml")


def test_logprob_is_the_log_softmax_in_float64():
    row = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 4
    want = torch.log_softmax(row.double(), 0)
    got = log_softmax(row)
    assert abs(np.exp(got).sum() - 1) < 1e-12
    assert np.abs(got - want.numpy()).max() < 1e-12  # a value against the math: a bound, not bits
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
                                        pool_pages=5), page_order_seed=1)
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


def test_streamed_pieces_join_to_the_reply_with_a_stop_string(tiny_models):
    """Text that may begin a stop string is held back, so a streamed reply never shows a stop's first half."""
    loaded = tiny_models["qwen2"]
    tok = loaded.tokenizer
    engine = Engine(loaded.model, EngineSettings(window=512, lanes=1), tok)
    prompt = tuple(tok.encode("def fibonacci(n):"))
    free = engine.generate([Request(prompt, max_tokens=24)])[0]
    stop = free.text[5:9]  # four characters from inside the free reply: the stopped reply ends before them
    pieces: list[str] = []
    stopped = engine.generate([Request(prompt, max_tokens=24, stop=(stop,))],
                              on_token=lambda _, __, piece: pieces.append(piece))[0]
    assert stopped.finish == "stop" and stopped.text == free.text[:free.text.index(stop)]
    assert "".join(pieces) == stopped.text
