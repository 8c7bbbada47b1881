"""Adam and the warm-up learning-rate schedule, written out like the backward (seed 004).

The update changes the parameters and the moment buffers in place: a training step allocates
nothing that lives past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfmcli.engine.model import arrays_repr

BETA1, BETA2, EPS = 0.9, 0.98, 1e-9  # "Attention Is All You Need", as seed 004 quotes it


def warmup_lr(step: int, d_model: int, warmup: int) -> float:
    """``d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``: linear up to ``warmup``, then
    falling as 1/sqrt(step). Its peak is at ``step = warmup``: ``(d_model * warmup)^-0.5``.

    ``step`` counts from 1.
    """
    for name, value in (("step", step), ("d_model", d_model), ("warmup", warmup)):
        if value < 1:
            raise ValueError(f"warmup_lr: {name}={value}; it must be at least 1 (step counts "
                             f"from 1)")
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@dataclass
class Adam:
    """The state of Adam: the step count and the first and second moments of each parameter."""

    m: dict
    v: dict
    t: int = 0
    beta1: float = BETA1
    beta2: float = BETA2
    eps: float = EPS

    def __repr__(self) -> str:
        return (f"Adam(m={arrays_repr(self.m)}, v={arrays_repr(self.v)}, t={self.t}, "
                f"beta1={self.beta1}, beta2={self.beta2}, eps={self.eps})")

    @classmethod
    def like(cls, params: dict, **hyper) -> "Adam":
        return cls({n: np.zeros_like(p) for n, p in params.items()},
                   {n: np.zeros_like(p) for n, p in params.items()}, **hyper)


def adam_step(params: dict, grads: dict, state: Adam, lr: float) -> None:
    """One Adam update of every parameter, in place.

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, and with the bias corrections
    ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)``:
    ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` (``torch.optim.Adam``'s order of operations).

    ``lr`` must be a number at least 0, as ``torch.optim.Adam`` requires: a NaN or a negative
    rate is refused before anything changes (a NaN would turn every parameter into NaN), and
    so is a parameter that cannot change in place (a float16 or bfloat16 run's weights are
    read-only: ``engine.precision.Cast``).
    """
    if not lr >= 0:   # also False for NaN
        raise ValueError(f"adam_step: lr={lr}; it must be a number at least 0")
    fixed = next((name for name, p in params.items() if not p.flags.writeable), None)
    if fixed is not None:
        raise ValueError(f"adam_step: {fixed} is read-only (a float16 or bfloat16 run's weights "
                         f"are: precision.Cast); give a copy, {{n: v.copy() for n, v in "
                         f"params.items()}}")
    state.t += 1
    b1, b2 = state.beta1, state.beta2
    correction1 = 1 - b1 ** state.t
    correction2 = 1 - b2 ** state.t
    for name, p in params.items():
        g, m, v = grads[name], state.m[name], state.v[name]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(correction2) + state.eps
        p -= (lr / correction1) * m / denom
