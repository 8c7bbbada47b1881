"""Adam by hand: a few entries of one parameter through a few training steps (``tfm adam``).

Seed 004 gives Adam's constants (beta1 0.9, beta2 0.98, eps 1e-9) and the warm-up schedule
``lr = d_model^-0.5 min(t^-0.5, t warmup^-1.5)``. This trains on the run's own batch, step by
step, with the hand-written backward and ``tfmcli.train.optim.adam_step``, and beside it writes out
every term of the update for the chosen entries: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 -
b2) g^2``, ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)`` and the step ``lr m_hat /
(sqrt(v_hat) + eps)``, in float64, each checked against the parameters the engine's update
leaves. At t = 1 the corrections make ``m_hat = g`` and ``v_hat = g^2``: every entry moves by
``lr g / (|g| + eps)``, about ``lr`` whatever the size of its gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.inputs import Inputs
from tfmcli.engine.model import Forward, backward, forward
from tfmcli.train.optim import Adam, adam_step, warmup_lr


class AdamStep(NamedTuple):
    t: int                 # the step, from 1
    lr: float              # its learning rate
    loss: float            # the loss before the update, at the parameters it starts from
    g: np.ndarray          # (k,) the gradient of the chosen entries
    m: np.ndarray          # b1 m + (1 - b1) g
    v: np.ndarray          # b2 v + (1 - b2) g^2
    m_hat: np.ndarray      # m / (1 - b1^t)
    v_hat: np.ndarray      # v / (1 - b2^t)
    update: np.ndarray     # lr m_hat / (sqrt(v_hat) + eps): what is subtracted
    p: np.ndarray          # the entries after the update, by these formulas
    engine_p: np.ndarray   # the same entries as tfmcli.train.optim.adam_step leaves them


class AdamExplained(NamedTuple):
    name: str
    entries: list          # the chosen entries' indices, as tuples
    p0: np.ndarray         # (k,) their values before the first step
    steps: list            # one AdamStep per update
    params: dict           # every parameter after the last update
    final: Forward         # the forward pass at them: its loss is the loss after the last update


def explain(params: dict, inputs: Inputs, cfg: Config, name: str, steps: int = 3, k: int = 4,
            warmup: int = 100, lr: float | None = None) -> AdamExplained:
    """``steps`` Adam updates of every parameter on ``inputs`` (``params`` are left as they
    were), and every term of the update for the ``k`` entries of ``name`` whose gradient is the
    largest at the first step. ``lr`` a constant rate instead of the warm-up schedule."""
    if name not in params:
        raise ValueError(f"explain: no parameter {name!r}")
    if steps < 1 or k < 1:
        raise ValueError(f"explain: steps={steps}, k={k}; each must be at least 1")
    work = {n: p.copy() for n, p in params.items()}
    state = Adam.like(work)
    b1, b2, eps = state.beta1, state.beta2, state.eps
    fwd = forward(work, inputs, cfg)
    grads = backward(work, fwd, cfg)
    flat = np.argsort(-np.abs(grads[name]).reshape(-1), kind="stable")[:k]
    flat = np.sort(flat)
    entries = [tuple(int(i) for i in np.unravel_index(f, params[name].shape)) for f in flat]
    p = params[name].reshape(-1)[flat].astype(np.float64)
    p0, m, v = p.copy(), np.zeros(flat.size), np.zeros(flat.size)
    done = []
    for t in range(1, steps + 1):
        rate = warmup_lr(t, cfg.d_model, warmup) if lr is None else lr
        g = grads[name].reshape(-1)[flat].astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        update = rate * m_hat / (np.sqrt(v_hat) + eps)
        p = p - update
        loss = fwd.loss
        adam_step(work, grads, state, rate)
        engine_p = work[name].reshape(-1)[flat].astype(np.float64)
        done.append(AdamStep(t, rate, loss, g, m, v, m_hat, v_hat, update, p, engine_p))
        fwd = forward(work, inputs, cfg)
        if t < steps:
            grads = backward(work, fwd, cfg)
    return AdamExplained(name, entries, p0, done, work, fwd)
