"""Penalties and biases a request puts on its logits row before the draw: functions of the row and the stream's
own tokens, in float32, one rounding an operation in a fixed order, so exact by construction (the same bits
alone or together, on every CPU).

The order and meanings are vLLM's: `bias` (OpenAI's logit_bias) is added first; then `repetition` (HF's and
vLLM's repetition_penalty) divides a positive logit of every token in the prompt or reply by it and multiplies a
negative one; then `frequency` is subtracted once per time the token stands in the reply and `presence` once if
it stands there at all (OpenAI's frequency_penalty and presence_penalty).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from tfq.errors import TfqError

MOST_BIAS = 100.0  # OpenAI's range for a logit_bias value
MOST_BIASED = 300  # OpenAI's most logit_bias entries
MOST_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
# repetition_penalty divides or multiplies a logit by at most 10: a logit stays finite (a tiny penalty, 1e-45,
# made every repeated positive logit +inf, and a row of infinities has nothing to draw)
LEAST_REPETITION, MOST_REPETITION = 0.1, 10.0
PROMPTS_KEPT = 64  # prompts whose token sets one Penalties keeps (a request's streams share their Penalties)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __bool__(self) -> bool:
        """Whether they change a row at all."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or any(b for _, b in self.bias))

    def validate(self, name: str, vocab: int | None = None) -> None:
        for key, most in (("presence", MOST_PENALTY), ("frequency", MOST_PENALTY)):
            value = getattr(self, key)
            if not (_number(value) and -most <= value <= most):
                raise TfqError(f"{name}: {key}_penalty must be a number in [-{most:g}, {most:g}], got {value!r}")
        if not (_number(self.repetition) and LEAST_REPETITION <= self.repetition <= MOST_REPETITION):
            raise TfqError(f"{name}: repetition_penalty must be in [{LEAST_REPETITION:g}, {MOST_REPETITION:g}] "
                           f"(1 leaves the row as it is), got {self.repetition!r}")
        if len(self.bias) > MOST_BIASED:
            raise TfqError(f"{name}: logit_bias names {len(self.bias)} tokens; at most {MOST_BIASED}")
        for token, value in self.bias:
            if not isinstance(token, int) or token < 0 or (vocab is not None and token >= vocab):
                raise TfqError(f"{name}: logit_bias names token {token!r}; token ids are in [0, {vocab or '?'})")
            if not (_number(value) and -MOST_BIAS <= value <= MOST_BIAS):
                raise TfqError(f"{name}: logit_bias of token {token} must be in [-100, 100], got {value!r}")

    def apply(self, row: torch.Tensor, prompt: Sequence[int], reply: Sequence[int]) -> torch.Tensor:
        """A new [vocab] fp32 row: `row` with the penalties of a stream holding `prompt` and then `reply`."""
        x = row.numpy().copy()
        if self.bias:
            ids, values = self._bias
            x[ids] += values  # a token named twice: the last wins
        if self.repetition != 1.0:
            seen = np.union1d(self._prompt_tokens(prompt), np.asarray(reply, dtype=np.int64))
            r, v = np.float32(self.repetition), x[seen]
            x[seen] = np.where(v > 0, v / r, v * r)
        if reply and (self.frequency or self.presence):
            ids, counts = np.unique(np.asarray(reply, dtype=np.int64), return_counts=True)
            if self.frequency:
                x[ids] -= np.float32(self.frequency) * counts.astype(np.float32)  # the product rounded, then the
            if self.presence:  # difference: two roundings (no fused multiply-add anywhere)
                x[ids] -= np.float32(self.presence)
        return torch.from_numpy(x)

    # What does not change from token to token, built once: on the engine thread, every step, for every stream

    @cached_property
    def _bias(self) -> tuple[np.ndarray, np.ndarray]:
        return bias_arrays(self.bias)

    @cached_property
    def _prompts(self) -> dict[int, tuple[Sequence[int], np.ndarray]]:
        return {}

    def _prompt_tokens(self, prompt: Sequence[int]) -> np.ndarray:
        """The distinct tokens of `prompt`, kept by the prompt's identity (the entry holds the prompt itself, so
        its id names it while kept)."""
        kept = self._prompts.get(id(prompt))
        if kept is not None and kept[0] is prompt:
            return kept[1]
        tokens = np.unique(np.asarray(prompt, dtype=np.int64))
        if len(self._prompts) >= PROMPTS_KEPT:
            self._prompts.pop(next(iter(self._prompts)))
        self._prompts[id(prompt)] = (prompt, tokens)
        return tokens


def bias_arrays(bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """logit_bias as (ids, float32 values), in its order."""
    return (np.array([t for t, _ in bias], dtype=np.int64), np.array([b for _, b in bias], dtype=np.float32))
