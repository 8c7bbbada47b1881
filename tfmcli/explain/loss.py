"""The LM head and the loss at one position, number by number, forward and backward (``tfm loss``).

Seed 001 derives the head's gradient: ``logits = h W_U + b_U``, ``p = softmax(logits)``, the
loss the mean of ``-log p[target]`` over the N scored positions, and ``dlogits = (p - y) / N``
with y one-hot at the target; then ``dh = dlogits W_U^T``. This recomputes every one of those
numbers for one position from the model's own input to the head, and checks them against the
model's logits and probabilities, the backward pass's gradients, and central differences.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import batched_central_differences
from tfmcli.engine import ops
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, check_within, head_weights


def input_name(cfg: Config) -> str:
    """The activation the head reads: ln_f's output in Pre-LN, the last block's in Post-LN."""
    return "ln_f.out" if cfg.norm == "pre" else f"blocks.{cfg.layers - 1}.out"


class LossExplained(NamedTuple):
    h: np.ndarray          # (d,) the head's input row
    logits: np.ndarray     # (V,) h W_U + b_U; with logit_softcap C, C tanh((h W_U + b_U) / C)
    top: float             # logits.max()
    shifted: np.ndarray    # (V,) logits - top
    exps: np.ndarray       # (V,) exp(shifted)
    total: float           # exps.sum()
    probs: np.ndarray      # (V,) exps / total
    target: int | None     # the next token, None where the position is not scored
    n: int                 # N: how many positions of the batch are scored
    term: float            # -log p[target] = log(total) - (logits[target] - top); 0 unscored
    term_share: float      # term / N: what this position adds to the loss
    p_minus_y: np.ndarray  # (V,) probs less 1 at the target, 0 unscored
    dlogits: np.ndarray    # (V,) p_minus_y / N
    dh: np.ndarray         # (d,) dz W_U^T
    numeric_dh: np.ndarray  # central differences of term / N in h
    z: np.ndarray          # (V,) h W_U + b_U: the logits before a cap (the logits, uncapped)
    dz: np.ndarray         # (V,) dlogits x slope: what the head's backward takes
    slope: np.ndarray      # (V,) the cap's 1 - (logits / C)^2; 1 everywhere without a cap


def shown_ids(probs: np.ndarray, target: int | None, k: int, whole: int = 32) -> list[int]:
    """The vocabulary's columns a view shows: every id when V <= ``whole``, else the target
    first and the k most likely of the others, likeliest first (ties by id)."""
    if probs.size <= whole:
        return list(range(probs.size))
    order = [int(i) for i in np.argsort(-probs, kind="stable") if i != target][:k]
    return ([target] if target is not None else []) + order


def explain(params: dict, fwd: Forward, cfg: Config, row: int, t: int,
            step: float = 1e-6) -> LossExplained:
    """The head and the loss at batch row ``row``, position ``t``, in float64. A row or
    position the run does not have is a ``ValueError``."""
    B, T = fwd.inputs.tokens.shape
    check_within("explain", row=(row, B), position=(t, T))
    W_U, b_U = head_weights(params, cfg)
    W_U, b_U = np.asarray(W_U, dtype=np.float64), np.asarray(b_U, dtype=np.float64)
    cache = fwd.caches["loss"]
    scored = bool(cache.valid[row, t])
    target = int(cache.targets[row, t]) if scored else None
    h = fwd.acts[input_name(cfg)][row, t].astype(np.float64)

    cap = cfg.logit_softcap

    def capped(z):   # the logits the softmax takes
        return z if cap is None else ops.softcap_forward(z, cap)

    z = h @ W_U + b_U

    def terms_moved(js, steps):
        """-log softmax(logits)[target] at h + steps[i] e_js[i], by log-sum-exp: moving h's
        entry j by s moves z = h W_U + b_U by s W_U[j]."""
        zs = capped(z + steps[:, None] * W_U[js])
        tops = zs.max(axis=-1)
        return np.log(np.exp(zs - tops[:, None]).sum(axis=-1)) - (zs[:, target] - tops)

    logits = capped(z)
    top = float(logits.max())
    shifted = logits - top
    exps = np.exp(shifted)
    total = float(exps.sum())
    probs = exps / total
    p_minus_y = np.zeros_like(probs)
    numeric = np.zeros_like(h)
    term = 0.0
    if scored:
        term = float(np.log(total) - shifted[target])
        p_minus_y = probs.copy()
        p_minus_y[target] -= 1.0
        numeric = batched_central_differences(terms_moved, h, step) / cache.n
    dlogits = p_minus_y / cache.n
    slope = np.ones_like(logits) if cap is None else ops.softcap_slope(logits, cap)
    dz = dlogits * slope
    return LossExplained(h, logits, top, shifted, exps, total, probs, target, cache.n, term,
                         term / cache.n, p_minus_y, dlogits, dz @ W_U.T, numeric, z, dz, slope)
