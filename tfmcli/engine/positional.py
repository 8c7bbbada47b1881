"""Positional encodings: the sinusoidal table added to the embedding, and RoPE's rotation
angles (applied to each head's queries and keys, ``ops.rope_forward``)."""

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


def angles(pos, d, base=10000.0):
    """(..., d): the angle of each column at position(s) ``pos``, ``pos / base^(2i/d)`` for
    the column pair (2i, 2i+1)."""
    i = np.arange(d) // 2                                      # pair index of each column
    return pos / float(base) ** (2 * i / d)


def wavelengths(d, base=10000.0):
    """(d,): the period in positions of each column, 2 pi * base^(2i/d)."""
    i = np.arange(d) // 2
    return 2 * np.pi * float(base) ** (2 * i / d)


def rope_angles(T, d_head, base=10000.0, scaling=None):
    """(T, d_head // 2): RoPE's angle of rotation pair i at position t, ``t / base^(2i/n)``,
    n = 2 (d_head // 2) the rotated dimensions (d_head itself when it is even). The base is
    10000 in RoFormer and LLaMA 1 and 2 (``Config.rope_theta``, Hugging Face's ``rope_theta``);
    LLaMA 3 turns slower, at 500000. With ``scaling`` (``Config.rope_scaling``: LLaMA 3.1's,
    or linear) each pair's angle is multiplied by its ``rope_scale`` (linear: divided by the
    factor).

    Pair i is the dimensions (i, i + d_head // 2) of a head, the "rotate half" layout of
    GPT-NeoX and Hugging Face's LLaMA (the RoFormer paper pairs neighbours (2i, 2i + 1): the
    same rotations, with a head's dimensions in another order). An odd d_head leaves its last
    dimension unrotated, as GPT-NeoX's ``rotary_pct`` leaves the dimensions past its rotated
    ones."""
    n = 2 * (d_head // 2)   # the sinusoidal table's angles over n columns: one per pair
    angle = angles(np.arange(T, dtype=np.float64)[:, None], n, base)[:, 0::2]
    if scaling is None:
        return angle
    if len(scaling) == 1:   # linear (config.LinearRopeScaling): every angle / factor
        return angle / scaling[0]
    return angle * rope_scale(d_head, base, scaling)


def rope_scale(d_head, base, scaling):
    """(d_head // 2,): what the scaling multiplies each pair's frequency by. Linear scaling
    (``config.LinearRopeScaling``): 1 / factor for every pair. LLaMA 3.1's
    (``config.RopeScaling``) decides from each pair's wavelength λ (positions per turn) at
    ``base``. With C the original context, ``C / high_freq_factor`` < ``C / low_freq_factor``:
    - λ < C / high_freq_factor: 1 (the fast pairs, which turn many times within C, kept);
    - λ > C / low_freq_factor: 1 / factor (the slow ones, slowed factor times);
    - between: (1 - s) / factor + s, s = (C / λ - low_freq_factor) / (high_freq_factor -
      low_freq_factor), which runs from 0 at the slow end to 1 at the fast one.
    """
    if len(scaling) == 1:
        return np.full(d_head // 2, 1 / scaling[0])
    factor, low, high, context = scaling
    n = 2 * (d_head // 2)
    wavelength = wavelengths(n, base)[0::2]                       # one per pair
    smooth = (context / wavelength - low) / (high - low)
    scale = np.where(wavelength > context / low, 1 / factor, (1 - smooth) / factor + smooth)
    return np.where(wavelength < context / high, 1.0, scale)


def rope_tables(T, d_head, dtype=np.float64, base=10000.0, scaling=None):
    """(cos, sin), each (T, d_head): the cosine and sine of each dimension's angle at each
    position (``rope_angles``, pair i's angle at dimensions i and i + d_head // 2; an odd
    d_head's last dimension has cos 1 and sin 0, unrotated)."""
    angle = rope_angles(T, d_head, base, scaling)                  # (T, m)
    cos, sin = np.ones((T, d_head)), np.zeros((T, d_head))
    m = d_head // 2
    cos[:, :m] = cos[:, m:2 * m] = np.cos(angle)
    sin[:, :m] = sin[:, m:2 * m] = np.sin(angle)
    return cos.astype(dtype), sin.astype(dtype)


def rope_scores(T, d_head, base=10000.0, scaling=None, turned=None):
    """(T, T): ``u_rot(t) . u_rot(s)`` for u = (1, ..., 1) / sqrt(d_head), one vector turned
    at t against itself turned at s (``tfm pe --rope``). It depends on t - s only: it is
    ``sum_i 2 cos((t - s) theta_i) / d_head``, plus ``1 / d_head`` for each unturned
    dimension (an odd head's last; with ``turned``, RoPE on the first ``turned`` dimensions
    only, ``Config.rotary_dim``, the rest)."""
    from tfmcli.engine import ops

    cos, sin = rope_tables(T, turned or d_head, base=base, scaling=scaling)
    u = ops.rope_forward(np.full((T, d_head), 1 / np.sqrt(d_head)), cos, sin)   # (T, d_head)
    return u @ u.T


def alibi_slopes(heads):
    """(heads,): ALiBi's slope of each head (Press, Smith and Lewis, "Train Short, Test Long",
    2022), the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8) for n heads when n is a
    power of two. Otherwise n is the largest power of two below ``heads``: the first n heads
    take n's sequence and the rest take every other slope of 2n's, 2^(-4/n), 2^(-12/n), ...
    (BLOOM's ``_get_alibi_slopes`` and MPT's ``gen_slopes`` give these numbers)."""
    n = 2 ** int(np.floor(np.log2(heads)))
    first = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
    rest = 2.0 ** (-4.0 * np.arange(1, 2 * (heads - n), 2) / n)
    return np.concatenate([first, rest])


def slope_name(m) -> str:
    """An ALiBi slope as the paper writes it: 1/16 for 2^-4, 2^-0.5 between powers of two."""
    k = -float(np.log2(m))
    return f"1/{2 ** round(k)}" if k == round(k) else f"2^-{k:g}"


def alibi_distances(T, dtype=np.float64):
    """(T, T): ``i - j``, how far key j lies behind query i (negative for a key ahead of it)."""
    t = np.arange(T)
    return (t[:, None] - t[None, :]).astype(dtype)


def alibi_bias(T, heads, dtype=np.float64):
    """(heads, T, T): what ALiBi adds to head h's scaled score of query i at key j,
    ``-m_h (i - j)`` (``alibi_slopes``): 0 on the diagonal, more negative the further behind
    the key. A constant added to a whole row leaves its softmax as it is, so the models that
    add ``m_h j`` instead (BLOOM) or ``m_h (j - T + 1)`` (MPT) attend alike."""
    slopes = alibi_slopes(heads).astype(dtype)
    return slopes[:, None, None] * -alibi_distances(T, dtype) + 0.0   # + 0: no -0 on the diagonal
