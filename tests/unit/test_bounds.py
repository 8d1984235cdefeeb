"""Numbers that pass validation must not fail later: the penalties' bounds keep a row finite, a row with nothing
finite to draw from is a clear error (never an IndexError), and `Penalties` builds once what every token reuses
without moving a bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tfq.decode.penalties as penalties
from tfq.decode.penalties import Penalties
from tfq.decode.sampling import sample
from tfq.errors import TfqError

VOCAB = 512


def old_apply(p: Penalties, row: torch.Tensor, prompt, reply) -> torch.Tensor:
    """Penalties.apply as it was (447f76b): every array rebuilt at every token. The reference of the refactor."""
    x = row.numpy().copy()
    if p.bias:
        ids = np.array([t for t, _ in p.bias], dtype=np.int64)
        x[ids] += np.array([b for _, b in p.bias], dtype=np.float32)
    if p.repetition != 1.0:
        seen = np.unique(np.asarray([*prompt, *reply], dtype=np.int64))
        r, v = np.float32(p.repetition), x[seen]
        x[seen] = np.where(v > 0, v / r, v * r)
    if reply and (p.frequency or p.presence):
        ids, counts = np.unique(np.asarray(reply, dtype=np.int64), return_counts=True)
        if p.frequency:
            x[ids] -= np.float32(p.frequency) * counts.astype(np.float32)
        if p.presence:
            x[ids] -= np.float32(p.presence)
    return torch.from_numpy(x)


def test_penalized_rows_are_the_bits_of_the_old_apply():
    """Random penalties (a token biased twice included), prompts and replies, token after token on one Penalties
    (its kept prompt sets reused, and evicted past the bound): torch.equal with the old apply at every step."""
    rng = np.random.default_rng(7)
    prompts = [tuple(int(t) for t in rng.integers(0, VOCAB, n)) for n in (1, 5, 40, 300)]
    for case in range(40):
        bias = tuple((int(t), float(np.float32(rng.uniform(-100, 100)))) for t in rng.integers(0, VOCAB, case % 7))
        p = Penalties(float(rng.uniform(-2, 2)) if case % 3 else 0.0, float(rng.uniform(-2, 2)) if case % 4 else 0.0,
                      float(rng.choice([1.0, 0.1, 0.7, 1.3, 10.0])), bias + bias[:1])
        for prompt in prompts * (1 + (case == 0) * penalties.PROMPTS_KEPT):
            prompt = tuple(prompt) if case else tuple(list(prompt))  # case 0: a new object each time
            reply: list[int] = []
            for _ in range(6):
                row = torch.from_numpy((rng.standard_normal(VOCAB) * 8).astype(np.float32))
                assert torch.equal(p.apply(row, prompt, reply), old_apply(p, row, prompt, reply))
                reply.append(int(rng.integers(0, VOCAB)))
        assert len(p._prompts) <= penalties.PROMPTS_KEPT


def test_the_bias_arrays_are_built_once_per_penalties_not_per_token(monkeypatch):
    built = []
    real = penalties.bias_arrays
    monkeypatch.setattr(penalties, "bias_arrays", lambda bias: built.append(bias) or real(bias))
    p = Penalties(bias=tuple((t, 1.0) for t in range(300)))
    row = torch.zeros(VOCAB)
    for n in range(20):
        p.apply(row, (1, 2), list(range(n)))
    assert len(built) == 1


@pytest.mark.parametrize("penalized", [
    Penalties(repetition=1e-45), Penalties(repetition=0.09), Penalties(repetition=11.0),
    Penalties(presence=float("nan")), Penalties(frequency=float("inf")), Penalties(presence=2.5),
    Penalties(repetition=float("nan")), Penalties(bias=tuple((t, 1.0) for t in range(301))),
    Penalties(bias=((5, float("inf")),)), Penalties(presence=True),
])
def test_numbers_past_their_bounds_are_refused_in_one_line(penalized):
    with pytest.raises(TfqError) as e:
        penalized.validate("request", VOCAB)
    assert "\n" not in str(e.value)


def test_at_their_bounds_the_penalized_row_stays_finite():
    """The largest penalties on logits far past any model's: every entry finite, so every draw has a row."""
    row = torch.linspace(-1e4, 1e4, VOCAB)
    for p in (Penalties(2.0, 2.0, 0.1, ((0, 100.0), (VOCAB - 1, -100.0))), Penalties(-2.0, -2.0, 10.0, ((1, -100.0),))):
        p.validate("request", VOCAB)
        shaped = p.apply(row, tuple(range(VOCAB)), list(range(VOCAB)) * 8)
        assert bool(torch.isfinite(shaped).all())
        for t in (0.0, 1.0):
            sample(shaped, t, 0.9, 1, 3)


def rows() -> dict[str, torch.Tensor]:
    base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    out = {"all -inf": torch.full((VOCAB,), float("-inf"))}
    for name, value in (("a NaN", float("nan")), ("a +inf", float("inf"))):
        row = base.clone()
        row[VOCAB // 2] = value
        out[name] = row
    out["NaN and -inf"] = torch.where(base > 0, float("nan"), float("-inf"))
    return out


@pytest.mark.parametrize("name", list(rows()))
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.5), (1e-40, 1.0)])
def test_a_row_with_nothing_finite_to_draw_is_a_clear_error(name, temperature, top_p):
    with pytest.raises(TfqError, match="no finite largest logit") as e:
        sample(rows()[name], temperature, top_p, 3, 9)
    assert "position 9" in str(e.value) and "\n" not in str(e.value)


def test_a_temperature_under_float32s_least_draws_the_largest():
    """T = 1e-300 is 0 in float32: logits / T's largest is 0 / 0. T -> 0 keeps only the largest logits."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    row[[7, 300]] = row.max() + 1
    drawn = {sample(row, 1e-300, top_p, seed, 4) for seed in range(40) for top_p in (1.0, 0.5)}
    assert drawn == {7, 300}
    masked = torch.where(torch.arange(VOCAB) % 2 == 0, row, float("-inf"))  # a grammar's mask: -inf beside
    assert sample(masked, 1e-300, 1.0, 0, 4) == 300
