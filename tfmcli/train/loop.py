"""Training a small model on a toy task with the hand-written backward and Adam.

Nothing here is new math: each step is ``forward``, ``backward`` and ``adam_step``; what this
module adds is the loop, the held-out accuracy, and a record of the curve.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tfmcli.engine import parallel
from tfmcli.engine.config import Config
from tfmcli.engine.inputs import IGNORE, Inputs
from tfmcli.engine.model import backward, forward, largest_product, unchecked_forward
from tfmcli.errors import TfmError
from tfmcli.train.optim import Adam, adam_step, warmup_lr
from tfmcli.train.tasks import make_batch


@dataclass
class History:
    """What a training run did: per step, the learning rate and the training batch's loss and
    answer-token accuracy."""

    steps: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)


def token_accuracy(logits: np.ndarray, targets: np.ndarray) -> float:
    """The fraction of positions with a target where the most likely token is the target."""
    scored = targets != IGNORE                                  # (B, T)
    return float((logits.argmax(axis=-1)[scored] == targets[scored]).mean())


def evaluate(params: dict, cfg: Config, inputs: Inputs):
    """(token accuracy over the answer positions, the forward pass) on ``inputs``."""
    B, T = inputs.tokens.shape
    fwd = forward(params, inputs, cfg.replace(batch=B, seq_len=T, lengths=None))
    return token_accuracy(fwd.acts["logits"], inputs.targets), fwd


def train(
    params: dict,
    cfg: Config,
    task: str,
    rng,
    *,
    steps: int,
    n: int,
    symbols: int,
    warmup: int,
    lr: float | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> History:
    """Train ``params`` in place for ``steps`` steps of ``cfg.batch`` fresh examples each.

    Parameters
    ----------
    cfg : Config
        Its ``seq_len`` must be ``2 n`` and its ``vocab`` ``symbols + 1`` (see ``tasks``).
    rng : np.random.Generator
        Draws the training examples.
    warmup : int
        Steps of the warm-up schedule ``warmup_lr``; ignored when ``lr`` is given.
    lr : float, optional
        A constant learning rate instead of the schedule.
    on_step : callable(step, loss, accuracy), optional
        Called after every step (a progress bar).
    """
    state = Adam.like(params)
    history = History()
    # a small model's products each on one BLAS thread: see parallel.one_blas_thread
    with parallel.one_blas_thread() if small(cfg) else contextlib.nullcontext():
        for step in range(1, steps + 1):
            inputs = make_batch(task, rng, cfg.batch, n, symbols)
            # the first step checks params and inputs; the later ones are of the same kinds
            fwd = (forward if step == 1 else unchecked_forward)(params, inputs, cfg)
            if not math.isfinite(fwd.loss):   # diverged: every later number would be NaN
                before = (f" (it was {history.losses[-1]:.6g} at step {step - 1})"
                          if history.losses else "")
                raise TfmError(f"the loss stopped being finite at step {step}{before}; "
                               f"try a smaller --lr or a longer --warmup")
            grads = backward(params, fwd, cfg)
            rate = lr if lr is not None else warmup_lr(step, cfg.d_model, warmup)
            adam_step(params, grads, state, rate)
            accuracy = token_accuracy(fwd.acts["logits"], inputs.targets)
            history.steps.append(step)
            history.lrs.append(rate)
            history.losses.append(fwd.loss)
            history.accuracies.append(accuracy)
            if on_step is not None:
                on_step(step, fwd.loss, accuracy)
    return history


def small(cfg: Config) -> bool:
    """Whether every matrix product of a step is under ``parallel.SMALL``: then the steps run
    on one BLAS thread (``parallel.one_blas_thread``)."""
    return largest_product(cfg, cfg.batch, cfg.seq_len) < parallel.SMALL
