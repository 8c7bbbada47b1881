"""How every number in tfm is written, so that columns of numbers line up."""

from __future__ import annotations

import math


def fmt(value: float, precision: int = 4) -> str:
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
    if v == 0:
        return f" {0:.{precision}f}"
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:+.{precision}f}"
    return f"{v:+.{precision}e}"


def fmt_fixed(value: float, precision: int = 2) -> str:
    """Like :func:`fmt` but always fixed point: the short form used inside heatmap cells.

    A heatmap is a picture, so its cells stay narrow; a tiny non-zero value prints as ``+0.00``
    (with its sign), which still tells it apart from an exact zero (`` 0.00``).
    """
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v == 0:
        return fmt(v, precision)
    return f"{v:+.{precision}f}"
