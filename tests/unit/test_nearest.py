"""tfq/nearest.py gives the float32 nearest the exact value (mpmath at 100 bits decides), whatever float64 value
the platform's library hands it, as long as that is within MARGIN: the same bits on every machine."""
from __future__ import annotations

import mpmath
import numpy as np
import pytest

from tfq.nearest import BLOCK, MARGIN, _round32, cos32, exp32, log64, nearest32, pow32, sin32


def exact32(function: str, *args: float) -> np.float32:
    with mpmath.workprec(100):
        return _round32(getattr(mpmath, function)(*(mpmath.mpf(float(a)) for a in args)))


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.int32), np.asarray(b, np.float32).view(np.int32))


RNG = np.random.default_rng(3)
# normal range, float32 subnormals and underflow, the edge of overflow
EXP_ARGS = np.concatenate([RNG.uniform(-80, 80, 400), RNG.uniform(-104.5, -87, 200), RNG.uniform(88.5, 88.8, 50),
                           [0.0, -0.0, 88.72283935546875, -103.97207708]])


@pytest.mark.parametrize("name,ours,args", [
    ("exp", exp32, (EXP_ARGS,)),
    ("cos", cos32, (RNG.uniform(-5e4, 5e4, 400).astype(np.float32),)),
    ("sin", sin32, (RNG.uniform(-5e4, 5e4, 400).astype(np.float32),)),
    ("power", pow32, (np.full(64, 1e6), (np.arange(0, 128, 2) / 128).astype(np.float32))),
])
def test_each_value_is_the_nearest_float32(name, ours, args):
    got = ours(*args)
    want = np.array([exact32(name, *(a.flat[i] for a in args)) for i in range(args[0].size)], dtype=np.float32)
    assert same_floats(got, want)


def test_a_value_near_a_midpoint_is_decided_exactly():
    """float64 values a hair (2e-14, relatively) on either side of a point halfway between two float32s, spread
    over several blocks of nearest32's passes (on their edges too): the exact side wins. The control: plain
    rounding of the float64 value that fell on the wrong side of the midpoint (as another library's last bit
    could) gives the other float32 (RED by construction)."""
    n = 3 * BLOCK + 100
    where = np.unique(np.concatenate([RNG.choice(n, 300, replace=False), [0, BLOCK - 1, BLOCK, 2 * BLOCK, n - 1]]))
    f = RNG.uniform(1, 2, n).astype(np.float32).astype(np.float64)
    mid = f.copy()  # float32s elsewhere: not doubtful
    mid[where] += np.spacing(f[where].astype(np.float32)).astype(np.float64) / 2
    for side in (-2e-14, 2e-14):
        exact, wrong = mid.copy(), mid.copy()
        exact[where] *= 1 + side
        wrong[where] *= 1 - side  # the same distance on the other side: within MARGIN of the exact value
        assert np.all(np.abs(wrong - exact) <= np.abs(exact) * MARGIN)
        got = nearest32(wrong, lambda i, side=side: mpmath.mpf(float(mid.flat[i])) * (1 + mpmath.mpf(side)))
        assert same_floats(got, exact.astype(np.float32))
        assert not same_floats(wrong.astype(np.float32), exact.astype(np.float32))  # control


def test_a_long_row_is_rounded_value_by_value():
    """exp32 of a row longer than a block equals exp32 of each value alone (the blocks' edges drop nothing)."""
    x = RNG.uniform(-30, 0, 2 * BLOCK + 7)
    alone = np.concatenate([exp32(x[i:i + 1]) for i in range(len(x))])
    assert same_floats(exp32(x), alone)


def test_the_log_of_a_sum_is_the_nearest_float64():
    for x in (1.0, 2.5, 151936.0, 1e-300, 3.0e5 + 1 / 3):
        with mpmath.workprec(200):
            assert log64(x) == float(mpmath.log(mpmath.mpf(x)))
