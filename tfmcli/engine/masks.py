"""Attention masks as boolean arrays, True = may attend (the convention of seed 004)."""

from __future__ import annotations

import numpy as np


def causal_mask(T):
    """(T, T): query t may attend to keys 0..t."""
    return np.tril(np.ones((T, T), dtype=bool))


def sliding_window_mask(T, window):
    """(T, T): query t may attend to the ``window`` keys t - window + 1 .. t (Mistral's sliding
    window, Hugging Face's ``sliding_window``): causal, and nothing further back."""
    t = np.arange(T)
    return causal_mask(T) & (t[None, :] > t[:, None] - window)


def padding_mask(lengths, T):
    """(B, T): key s of row b is visible while s < lengths[b]."""
    return np.arange(T)[None, :] < np.asarray(lengths)[:, None]


def combined_mask(lengths, T, causal=True, window=None):
    """(B, T, T): padding keys are hidden from every query; with ``causal``, so is the future;
    with a sliding ``window`` (causal only), so is every key ``window`` or more places back.

    Queries at padded positions see what the row's last real query sees: its real keys, or
    with a window the last ``window`` of them. So no row is ever all hidden (every length is at
    least 1).
    """
    lengths = np.asarray(lengths)
    mask = np.broadcast_to(padding_mask(lengths, T)[:, None, :], (len(lengths), T, T))
    if causal:
        mask = mask & causal_mask(T)
    if window is not None:
        if not causal:
            raise ValueError("a sliding window hides keys behind a causal query; causal=False")
        t = np.arange(T)
        last = np.minimum(t[None, :], lengths[:, None] - 1)                 # (B, T): query seen as
        mask = mask & (t[None, None, :] > last[:, :, None] - window)
    return np.array(mask)


def additive(mask, dtype=np.float64):
    """The 0 / -inf form added to the scores before the softmax."""
    return np.where(mask, 0.0, -np.inf).astype(dtype)
