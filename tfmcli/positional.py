"""Sinusoidal positional encoding."""

from __future__ import annotations

import numpy as np


def sinusoidal(T, d, dtype=np.float64):
    """(T, d): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)).

    Column pair (2i, 2i+1) shares one frequency. An odd d is allowed: its last column is the sine
    of the next pair, whose cosine would fall outside the matrix. (Seed 004's loop divides by
    10000^(2*j/d) with j already even, and gives the cosine its own exponent: both are wrong.)
    """
    angle = angles(np.arange(T, dtype=np.float64)[:, None], d)    # (T, d)
    pe = np.where(np.arange(d) % 2 == 0, np.sin(angle), np.cos(angle))
    return pe.astype(dtype)


def angles(pos, d):
    """(..., d): the angle of each column at position(s) ``pos``, ``pos / 10000^(2i/d)`` for
    the column pair (2i, 2i+1)."""
    i = np.arange(d) // 2                                      # pair index of each column
    return pos / 10000.0 ** (2 * i / d)


def wavelengths(d):
    """(d,): the period in positions of each column, 2 pi * 10000^(2i/d)."""
    i = np.arange(d) // 2
    return 2 * np.pi * 10000.0 ** (2 * i / d)
