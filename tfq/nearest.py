"""exp, log, sin, cos and powers rounded to the float32 nearest the exact value: the same bits on every machine.

torch's and numpy's float32 exp, sin, cos and pow are vector code picked by the CPU's instruction set (Sleef at
AVX2 or AVX-512, libm's scalar code at the baseline); each is within an ulp or so, but not the same ulp, so a
table built with them (the rotary angles, a DeltaNet's decay rates, a sampler's probabilities) has other bits on
another CPU. tfq rounds the exact value instead, which has one answer everywhere (Ziv's strategy): the float64
value (any libm, any vector code: all are within a few float64 ulps) decides the float32 unless it lies within
MARGIN of a point halfway between two float32s; those few are decided by mpmath at 100 bits, pure Python,
the same on every machine.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

# A float64 result within 2^-44 of the exact value, relatively (2^9 float64 ulps: far more than any libm or
# vector library errs), rounds to the same float32 as the exact value unless it lies within that of a point
# halfway between two float32s: its 29 low mantissa bits (the ones float32 drops) near 2^28, give or take 2^9.
MARGIN = 2.0 ** -44
_NEAR = 2 ** 9
_LOW, _HALF = (1 << 29) - 1, 1 << 28
_NORMAL, _TOP = 2.0 ** -126, float(np.finfo(np.float32).max)


BLOCK = 8192  # values a pass: the temporaries of a block stay in cache (whole-row temporaries cost page faults)


def nearest32(approx: np.ndarray, exact: Callable) -> np.ndarray:
    """The float32 nearest each exact value, given `approx` (float64, within MARGIN relatively) and `exact`:
    index -> that value as an mpmath number, asked only where approx cannot decide."""
    approx = np.ascontiguousarray(approx, dtype=np.float64)
    flat = approx.reshape(-1)
    return _by_blocks(approx.shape, lambda part, out: flat[part], exact)


def _by_blocks(shape: tuple, approx_of: Callable, exact: Callable) -> np.ndarray:
    """nearest32 a block at a time: approx_of(slice, float64 buffer) -> the block's float64 values."""
    n = int(np.prod(shape))
    f = np.empty(n, dtype=np.float32)
    buffer, low = np.empty(min(n, BLOCK)), np.empty(min(n, BLOCK), dtype=np.int64)
    for start in range(0, n, BLOCK):
        part = slice(start, min(n, start + BLOCK))
        with np.errstate(over="ignore"):
            approx = approx_of(part, buffer[: part.stop - start])
            f[part] = approx  # to nearest, ties to even: right wherever approx is not doubtful
        for i in _doubtful(approx, low[: part.stop - start]):
            if np.isfinite(approx[i]):
                f[start + i] = _round32(exact(start + i))
    return f.reshape(shape)


def _doubtful(approx: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Where approx (one block) lies within MARGIN of a float32 midpoint, or of float32's subnormals or overflow."""
    np.bitwise_and(approx.view(np.int64), _LOW, out=low)
    low -= _HALF
    np.abs(low, out=low)
    doubtful = low <= _NEAR
    lo, hi = (float(approx.min()), float(approx.max())) if approx.size else (1.0, 1.0)
    if not (lo >= _NORMAL or hi <= -_NORMAL):  # some |value| may be below float32's normals (or NaN: min says so)
        magnitude = np.abs(approx)
        tiny = np.flatnonzero(magnitude < _NORMAL)  # float32 subnormals: steps of 2^-149 whatever the magnitude
        steps = magnitude[tiny] * 2.0 ** 149  # exact
        doubtful[tiny] = np.abs(steps - np.floor(steps) - 0.5) <= steps * MARGIN + 2.0 ** -60
    if not max(abs(lo), abs(hi)) < _TOP * (1 - MARGIN):  # near float32's largest: overflow or not, decided exactly
        doubtful |= np.abs(approx) >= _TOP * (1 - MARGIN)
    return np.flatnonzero(doubtful)


def _round32(value) -> np.float32:
    """An mpmath number rounded to the nearest float32 (ties to even), subnormals and overflow included."""
    import mpmath

    if value == 0:
        return np.float32(0.0)
    with mpmath.workprec(200):
        exponent = max(int(mpmath.frexp(value)[1]) - 1, -126)  # |value| in [2^exponent, 2^(exponent + 1))
        n = int(mpmath.nint(mpmath.ldexp(value, 23 - exponent)))  # in float32 steps; nint: half to even
    with np.errstate(over="ignore"):
        return np.float32(float(mpmath.ldexp(n, exponent - 23)))  # n < 2^25: exact in float64, then float32


def _mp(function: str, *args: np.ndarray) -> Callable:
    """index -> function(args at that index), exactly (float64 inputs are exact mpmath numbers)."""
    def exact(i):
        import mpmath

        with mpmath.workprec(100):
            return getattr(mpmath, function)(*(mpmath.mpf(float(a.flat[i])) for a in args))
    return exact


def _inputs(*args) -> list[np.ndarray]:
    """The arguments as flat float64 arrays of one broadcast shape, and that shape."""
    arrays = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in args))
    return [np.ascontiguousarray(a).reshape(-1) for a in arrays], arrays[0].shape


def _rounded(function: str, *args) -> np.ndarray:
    """numpy's float64 `function` of args, a block at a time, rounded to the nearest float32 (mpmath's decides)."""
    flat, shape = _inputs(*args)
    ufunc = getattr(np, function)
    return _by_blocks(shape, lambda part, out: ufunc(*(a[part] for a in flat), out=out), _mp(function, *flat))


def exp32(x) -> np.ndarray:
    """exp(x) for float64 (or float32) x, rounded to float32."""
    return _rounded("exp", x)


def cos32(x) -> np.ndarray:
    return _rounded("cos", x)


def sin32(x) -> np.ndarray:
    return _rounded("sin", x)


def pow32(base, exponent) -> np.ndarray:
    """base ** exponent (base > 0), rounded to float32."""
    return _rounded("power", base, exponent)


def log64(x: float) -> float:
    """log(x) rounded to float64 (one number: mpmath decides it alone)."""
    import mpmath

    with mpmath.workprec(100):
        return float(mpmath.log(mpmath.mpf(float(x))))
