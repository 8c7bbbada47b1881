"""How every number in tfm is written, so that columns of numbers line up."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

FIXED_RANGE = (1e-3, 1e5)   # |v| written in fixed point; outside it, scientific
NOISE = 32                  # a value within NOISE ulps of a column's scale is zero (see below)


def fmt(value: float, precision: int = 4, style: str | None = None, sign: bool = True) -> str:
    """Write one number the way every table in tfm writes it.

    Fixed point with an explicit sign when ``1e-3 <= |value| < 1e5``, scientific otherwise, so
    that a column of right-justified numbers lines up on the decimal point and a tiny gradient
    never prints as ``+0.0000``. Exact zero (and ``-0.0``) gets a space where the sign would go:
    it is neither positive nor negative, and it keeps the width of its neighbours.

    Parameters
    ----------
    value : float
    precision : int
        Digits after the decimal point (of the mantissa, when scientific).
    style : "fixed", "sci", "indicator" or None
        Force one notation, so that a whole column is written alike (see :func:`notation`);
        None picks it per value. "indicator" writes a 0/1 quantity (ReLU's slope) as 0 and 1.
    sign : bool
        Write the ``+`` of positive numbers; False for quantities that are never negative
        (norms, maxima of absolute values), where it says nothing.

    Returns
    -------
    str
        ``"+0.5000"``, ``"-1.2346e+05"``, ``" 0.0000"``, ``"-inf"``, ``"+inf"`` or ``"nan"``.

    Examples
    --------
    >>> fmt(-0.5, 3)
    '-0.500'
    >>> fmt(0.0)
    ' 0.0000'
    >>> fmt(12345678.0, 2)
    '+1.23e+07'
    """
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "+inf" if v > 0 else "-inf"
    plus = "+" if sign else ""
    if style == "indicator" and v in (0.0, 1.0):
        return f"{v:.0f}"
    if v == 0:
        return f"{' ' if sign else ''}{0:.{precision}f}"
    if style is None or style == "indicator":
        style = "fixed" if FIXED_RANGE[0] <= abs(v) < FIXED_RANGE[1] else "sci"
    if style == "fixed":
        return f"{v:{plus}.{precision}f}"
    return f"{v:{plus}.{precision}e}"


def notation(values, indicator: bool = False) -> str:
    """One notation for a column, as NumPy picks one for a whole array: "fixed" when every
    finite non-zero value lies in the fixed-point range, else "sci". A column never mixes
    ``+1.000e-03`` with ``+0.002``. With ``indicator``, values that are all 0 or 1 (some 1)
    are "indicator": written 0 and 1, as the 0/1 quantity they are."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if indicator and values.size and np.isin(values, (0.0, 1.0)).all() and (values == 1).any():
        return "indicator"
    size = np.abs(values)
    size = size[np.isfinite(size) & (size != 0)]
    if size.size == 0 or (size.min() >= FIXED_RANGE[0] and size.max() < FIXED_RANGE[1]):
        return "fixed"
    return "sci"


def negligible(value: float, scale: float, eps: float) -> bool:
    """Whether ``value`` is zero to working precision next to numbers of size ``scale``.

    The mean of a layer norm's output is 0 in exact arithmetic; computed, it is rounding noise
    such as ``-4.6e-18``. Anything within ``NOISE`` units of ``eps * scale`` is that noise (a
    sum of n terms carries about log2(n) such units).
    """
    return value != 0 and abs(value) <= NOISE * eps * scale


ZERO_TO_PRECISION = "≈0"


def fmt_fixed(value: float, precision: int = 2, sign: bool = True) -> str:
    """Like :func:`fmt` but always fixed point: the short form used inside heatmap cells.

    A heatmap is a picture, so its cells stay narrow. A signed cell's non-zero value too small
    for the digits shown prints as ``≈0``, never ``-0.00`` or ``+0.00``, and so still differs
    from an exact zero (`` 0.00``); an unsigned one (a probability) as ``0.00``.
    """
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v == 0:
        return fmt(v, precision, sign=sign)
    text = f"{v:{'+' if sign else ''}.{precision}f}"
    return ZERO_TO_PRECISION if sign and not text.strip("+-0.") else text


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with thousands separators and its noun, plural unless n is 1: "1 position",
    "1,024 positions" (``plural``, when adding an s will not do: "entries")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


DIGITS = 4   # significant digits of a column's largest number
EPS = float(np.finfo(np.float64).eps)


def column(values, eps: float = EPS, floor: float = 0.0) -> Callable[[float], str]:
    """How each number of a column is written: at the column's scale (its largest finite
    |value|) with four significant digits, in one notation (fixed point when the scale is in
    the CLI's fixed range, ``+0.1234``, ``+12.35``; else scientific, ``-1.600e-06``). A value
    the column's digits cannot show, or rounding noise next to its scale (``negligible``,
    ``eps`` the run's dtype's; next to ``floor`` when that is larger, as a parameter's
    gradient is next to the largest one's, as ``tfm check`` says) is ``≈0``; an exact zero
    is `` 0`` in the column's digits.

    >>> write = column([0.5, -3e-6, 0.0]); write(0.5), write(-3e-6), write(0.0)
    ('+0.5000', '≈0', ' 0.0000')
    >>> column([1.6e-06, -2e-7])(-2e-7)
    '-2.000e-07'
    """
    values = np.asarray(values, dtype=np.float64).ravel()
    finite = np.abs(values[np.isfinite(values)])
    scale = float(finite.max()) if finite.size else 0.0
    if scale == 0.0:
        return lambda v: fmt(v, DIGITS)
    fixed = FIXED_RANGE[0] <= scale < FIXED_RANGE[1]
    style = "fixed" if fixed else "sci"
    precision = max(0, DIGITS - 1 - math.floor(math.log10(scale))) if fixed else DIGITS - 1

    def write(value: float) -> str:
        v = float(value)
        if not math.isfinite(v) or v == 0:
            return fmt(v, precision)
        text = fmt(v, precision, style)
        if negligible(v, max(scale, floor), eps) or (fixed and not text.strip("+-0.")):
            return ZERO_TO_PRECISION
        return text

    return write

def one(value: float) -> str:
    """One number on its own, to four significant digits (``column`` of one)."""
    return column([value])(value)
