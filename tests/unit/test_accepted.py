"""The rule that accepts a drafter's guesses (tfq.engine.draft.accepted), which the engine's draw loop and the
tests both call: a draw confirms its guess only while every draw before it confirmed its own."""
from __future__ import annotations

import pytest

from tfq.engine.draft import accepted


@pytest.mark.parametrize("guesses, draws, kept", [
    ([5, 6, 8], [5, 6, 8, 4], 3),  # every guess confirmed, and the draw after the last
    ([5, 6, 8], [5, 6, 9], 2),  # the third draw refuses its guess
    ([5, 6, 8], [2], 0),  # the first draw refuses the first guess
    ([5, 6, 8], [5], 1),  # the stream stopped drawing (it finished) after one confirmed guess
    ([5, 6, 8], [], 0),
    ([], [7], 0),  # no guesses: a plain decode
    ([5, 6, 8], [5, 9, 8], 1),  # a draw equal to its guess after a refused one confirms nothing
])
def test_the_draws_confirm_the_guesses_up_to_the_first_that_differs(guesses, draws, kept):
    assert accepted(guesses, draws) == kept


def test_control_counting_equal_draws_anywhere_is_another_rule():
    """RED by construction: a rule that counts every draw equal to its guess (not only the unbroken run from the
    first) gives 2 where the rule gives 1, so the cases above tell them apart."""
    guesses, draws = [5, 6, 8], [5, 9, 8]
    anywhere = sum(g == d for g, d in zip(guesses, draws))
    assert anywhere == 2 != accepted(guesses, draws)
