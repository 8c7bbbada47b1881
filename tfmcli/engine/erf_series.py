"""erf of whole arrays, for the fast path's GELU (``ops.gelu_erf_forward_fast``).

NumPy has no erf, and ``ops.erf`` calls ``math.erf`` for every entry, about 0.15 us each. This
one works on whole arrays in about a third of that, within 2 ulp of ``math.erf`` (9 entries in
10 the same bits):

- ``|x| < 1``: ``erf(x) = x g(x^2)``, g the Taylor series ``2/sqrt(pi) sum (-u)^n / (n! (2n+1))``,
  18 terms (the 19th is under 1e-17 of the sum), so tiny x keep their relative accuracy;
- ``1 <= |x| < 6``: ``erf(x) = 1 - erfc(|x|)``, ``erfc(a) = exp(-a^2) R(a)``, R smooth: a
  Chebyshev series of 24 terms in ``1/a``, interpolated at its nodes from ``math.erfc``;
- ``|x| >= 6``: ``sign(x)`` (erfc(6) is 2e-17, under half an ulp of 1); nan stays nan.

Everything is computed in float64, ``CHUNK`` entries at a time so that the temporaries stay in
cache, and written back in x's dtype.
"""

from __future__ import annotations

import functools
import math

import numpy as np

CHUNK = 1 << 13          # entries a pass: 64 KiB per float64 temporary
TAYLOR_TERMS = 18
TAIL_START, TAIL_END = 1.0, 6.0
TAIL_TERMS = 24


def erf(x: np.ndarray) -> np.ndarray:
    """erf of every entry, in x's dtype (see the module's docstring)."""
    out = np.empty_like(x)
    flat, into = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        into[start:start + CHUNK] = _erf64(np.asarray(flat[start:start + CHUNK], np.float64))
    return out


def _erf64(x: np.ndarray) -> np.ndarray:
    """Both series on every entry, each where it holds chosen after (cheaper than sorting the
    entries out): the Taylor series on x clipped to [-1, 1], erfc's on |x| clipped to [1, 6]."""
    a = np.abs(x)
    near = np.clip(x, -TAIL_START, TAIL_START)
    near *= _horner(_taylor(), near * near)
    far = _erfc_tail(np.clip(a, TAIL_START, TAIL_END))
    np.subtract(1.0, far, out=far)
    np.copysign(far, x, out=far)
    far = np.where(a < TAIL_END, far, np.sign(x))   # |x| >= 6 (erfc under 2e-17), and nan
    return np.where(a < TAIL_START, near, far)


def _horner(coefficients: np.ndarray, u: np.ndarray) -> np.ndarray:
    """sum_n coefficients[n] u^n."""
    total = np.full_like(u, coefficients[-1])
    for c in coefficients[-2::-1]:
        total *= u
        total += c
    return total


def _erfc_tail(a: np.ndarray) -> np.ndarray:
    """erfc(a) for 1 <= a < 6: exp(-a^2) R(a), R's Chebyshev series in s = 1/a at its place
    t in [-1, 1] by Clenshaw's recurrence, b_j = c_j + 2t b_(j+1) - b_(j+2) (in place: three
    buffers in turn)."""
    c = _tail_series()
    t = np.divide(_S_SLOPE, a)
    t += _S_SHIFT
    two_t = 2.0 * t
    b0, b1, b2 = np.empty_like(t), np.full_like(t, c[-1]), np.zeros_like(t)
    for cj in c[-2:0:-1]:
        np.multiply(two_t, b1, out=b0)
        b0 -= b2
        b0 += cj
        b0, b1, b2 = b2, b0, b1
    b1 *= t
    b1 -= b2
    b1 += c[0]
    square = np.multiply(a, a, out=two_t)
    np.negative(square, out=square)
    b1 *= np.exp(square, out=square)
    return b1


# s = 1/a runs over [1/6, 1]; t = (2s - (1/6 + 1)) / (1 - 1/6) = _S_SLOPE / a + _S_SHIFT
_S_SLOPE = 2.0 / (1.0 - 1.0 / TAIL_END)
_S_SHIFT = -(1.0 + 1.0 / TAIL_END) / (1.0 - 1.0 / TAIL_END)


@functools.cache
def _taylor() -> np.ndarray:
    """g's coefficients, ``2/sqrt(pi) (-1)^n / (n! (2n+1))``."""
    return np.array([2.0 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1))
                     for n in range(TAYLOR_TERMS)])


@functools.cache
def _tail_series() -> np.ndarray:
    """The Chebyshev coefficients of R(a) = erfc(a) exp(a^2) in s = 1/a over [1/6, 1], from its
    values at the Chebyshev nodes (a cosine transform). exp(a^2) takes a^2 exactly: the square
    rounded, times exp of what the rounding left out."""
    n = TAIL_TERMS
    theta = np.pi * (np.arange(n) + 0.5) / n                    # the nodes: cos(theta)
    cosines = np.cos(np.outer(np.arange(n), theta)) * (2.0 / n)  # (term, node)
    cosines[0] /= 2.0
    lo, hi = 1.0 / TAIL_END, 1.0 / TAIL_START
    values = [_erfc_scaled(1.0 / (lo + (hi - lo) * (1.0 + c) / 2.0)) for c in np.cos(theta)]
    return cosines @ np.array(values)


def _erfc_scaled(a: float) -> float:
    from fractions import Fraction  # here: only the first call of the series needs it

    square = a * a
    left_out = float(Fraction(a) ** 2 - Fraction(square))
    return math.erfc(a) * math.exp(square) * (1.0 + left_out)
