"""Log-probabilities and the sampler without a model: the scores are functions of a row's bits at any thread
count, ties go to the lower id, a stop string's start is held back, a tiny temperature draws the argmax, and the
sampler draws what sorting the whole row draws. The engine's scores are in tests/test_logprobs.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hst

from tfq.decode.sampling import choice_seed, log_softmax, logprob
from tfq.engine.stream import held_back


def test_logprob_is_the_log_softmax_in_float64():
    """Within float32's rounding of each token's weight (tfq.decode.sampling.weights) of the exact log-softmax."""
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


@given(text=hst.text("ab", max_size=14), stops=hst.lists(hst.text("ab", min_size=1, max_size=9), min_size=1,
                                                          max_size=4))
def test_held_back_is_the_longest_end_that_begins_a_stop(text, stops):
    want = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    assert held_back(text, tuple(stops)) == want


def test_a_tiny_temperature_draws_the_most_likely_token_not_nan():
    """logits / 1e-40 overflows fp32; scaled from the row's max instead, the draw is the argmax (before: the
    probabilities were NaN and the draw the last id)."""
    from tfq.decode.sampling import sample

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    logits[7] = 12.0
    assert [sample(logits, t, 1.0, s, 3) for t in (1e-40, 1e-38, 1e-30) for s in (0, 1)] == [7] * 6
    assert not torch.isfinite(logits / 1e-40).all()  # the case is the overflow, by construction


def whole_order_draw(logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int,
                     higher_id_first: bool = False) -> int:
    """The sampler's recipe spelled out: every token sorted (by weight, then by id), the running sums of all of
    them, top-p's head, the keyed draw. higher_id_first breaks ties the other way (the control)."""
    from tfq.decode.sampling import draw_key, weights

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
    from tfq.decode.sampling import sample

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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_a_nan_or_an_infinity_anywhere_is_not_finite(bad):
    """finite() reads a row's largest and least value; a NaN or an infinity in any position makes it say so, and a
    row of finite values as large as a float32 holds (whose sum overflows) is still finite."""
    from tfq.decode.sampling import finite

    row = torch.randn(151936, generator=torch.Generator().manual_seed(0))
    assert finite(row)
    for at in (0, 77_777, len(row) - 1):
        hit = row.clone()
        hit[at] = bad
        assert not finite(hit)
    big = torch.full((8,), 3e38)
    assert not np.isfinite(float(big.sum())) and finite(big)
