"""Attention masks as boolean arrays, True = may attend (the convention of seed 004)."""

from __future__ import annotations

import numpy as np


def causal_mask(T):
    """(T, T): query t may attend to keys 0..t."""
    return np.tril(np.ones((T, T), dtype=bool))


def padding_mask(lengths, T):
    """(B, T): key s of row b is visible while s < lengths[b]."""
    return np.arange(T)[None, :] < np.asarray(lengths)[:, None]


def combined_mask(lengths, T, causal=True):
    """(B, T, T): padding keys are hidden from every query; with ``causal``, so is the future.

    Queries at padded positions still see the row's real keys, so no row is ever all hidden
    (key 0 is always visible, since every length is at least 1).
    """
    mask = np.broadcast_to(padding_mask(lengths, T)[:, None, :], (len(lengths), T, T))
    if causal:
        mask = mask & causal_mask(T)
    return np.array(mask)


def additive(mask, dtype=np.float64):
    """The 0 / -inf form added to the scores before the softmax."""
    return np.where(mask, 0.0, -np.inf).astype(dtype)
