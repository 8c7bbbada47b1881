"""Where precision goes: a run in float32, float16 or bfloat16 held against float64, tensor by
tensor (``tfm precision``).

The same weights and tokens run three times: in float64 (the truth), in the dtype (the run
people make: ``engine.precision``), and in the dtype again with every kept activation and
gradient replaced, as the pass keeps it, by the float64 run's rounded to the dtype
(``Forcing``). In that third run each operation reads float64's inputs rounded: what it makes
there is what the operation itself costs (its **own** error: the best a run in the dtype could
do at that point), and the difference between the first run's tensor and it is what the
operation **inherits** from the error its inputs brought. Each error is an RMS over the
tensor's finite float64 entries, relative to the tensor's float64 scale (its RMS), and read in
the dtype's machine epsilon; ``total <= own + inherited`` (the triangle inequality), which
``PrecisionReport.consistent`` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tfmcli.engine import precision
from tfmcli.engine.config import Config
from tfmcli.engine.inputs import Inputs
from tfmcli.engine.masks import padding_mask
from tfmcli.engine.model import backward, forward, unchecked_forward

ZERO = 1e-10   # a gradient whose float64 RMS is below this fraction of the largest is 0 but for
#                float64's rounding (b_K's: a shift of every key leaves each softmax as it was)
NEAR_TIE = 3.0   # top two logits closer than this many times the run's error in a difference of
#                  two logits there: a flip another rounding order may make or not (a near tie)


class Forcing:
    """A pass's plan (the interface of ``engine.interventions.Plan``) that keeps, as each
    activation and gradient is made, what the operation made (``made``; the gradients are the
    pass's own ``dacts``) and hands on the float64 run's instead, rounded to the dtype: each
    operation after it reads float64's inputs as the dtype holds them."""

    def __init__(self, truth, truth_grads, policy: precision.Precision, lengths):
        self.truth, self.truth_grads, self.policy = truth, truth_grads, policy
        self.steps = dict.fromkeys(truth.acts, ())   # every kept activation (attention by parts)
        self.lengths = np.asarray(lengths)
        self.interventions = ()
        self.made: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return True

    def apply(self, name: str, x: np.ndarray) -> np.ndarray:
        self.made[name] = x
        return self._rounded(self.truth.acts[name])

    def through(self, name: str, dx: np.ndarray) -> np.ndarray:
        return self._rounded(self.truth_grads.acts[name])

    def _rounded(self, x):
        """float64's ``x`` as the dtype holds it (float32's too: an exact policy rounds
        nothing, but its arrays are float32)."""
        return np.asarray(self.policy.round(x), dtype=self.policy.array)


@dataclass(frozen=True)
class TensorError:
    """One tensor's error in the dtype against float64.

    Attributes
    ----------
    name : str
        "blocks.0.attn.scores"; a gradient's "dblocks.0.attn.scores"; a parameter's gradient
        "grad blocks.0.attn.W_Q".
    kind : str
        "activation", "gradient" (of an activation) or "parameter gradient".
    scale : float
        The float64 tensor's RMS over its finite entries (for a tensor that is 0 but for
        rounding, ``zero``, the largest gradient's instead).
    rms, max : float
        RMS and largest |dtype - float64| over those entries, over ``scale``; inf when the
        dtype overflowed there, NaN when it made a NaN.
    own, inherited : float
        RMS of |own op - float64| and |dtype - own op| over ``scale`` (module docstring).
    inf, nan, flushed : int
        Entries the dtype made inf (float64's finite), NaN (float64's not), and 0 or subnormal
        in the dtype where float64's is not 0.
    eps : float
        The dtype's machine epsilon: ``in_eps`` is ``rms / eps``.
    zero : bool
        0 in exact arithmetic: its float64 RMS below ``ZERO`` of the largest gradient's.
    """

    name: str
    kind: str
    shape: tuple
    scale: float
    rms: float
    max: float
    own: float
    inherited: float
    inf: int
    nan: int
    flushed: int
    eps: float
    zero: bool = False

    @property
    def in_eps(self) -> float:
        return self.rms / self.eps

    def crosses(self, threshold: float) -> bool:
        """Its error is past ``threshold`` eps (a NaN's is)."""
        return not self.in_eps <= threshold

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape),
                "scale": self.scale, "rms": _number(self.rms), "max": _number(self.max),
                "in_eps": _number(self.in_eps), "own": _number(self.own),
                "inherited": _number(self.inherited), "inf": self.inf, "nan": self.nan,
                "flushed": self.flushed, "zero_in_exact_arithmetic": self.zero}


def _number(x: float):
    """A JSON number, or "inf" / "nan" (JSON has neither)."""
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class Position:
    """One scored position's next token in both runs."""

    row: int
    position: int
    truth: int        # float64's most likely next token
    low: int          # the dtype's
    gap: float        # float64's top two logits apart, in eps of their size
    kl: float         # KL(p_float64 || p_dtype) of the next-token distributions
    noise: float = 0.0   # the run's error in a difference of two logits there (sqrt 2 times
    #                      its logits' RMS error), in the same eps as ``gap``

    @property
    def flipped(self) -> bool:
        return self.truth != self.low

    @property
    def near_tie(self) -> bool:
        """The top two are closer than NEAR_TIE times the run's own error in a difference
        of two logits: a run rounding in another order (another kernel, torch's) may flip
        here or not. A flip past it is one every run in the dtype makes."""
        return self.gap < NEAR_TIE * self.noise


@dataclass(frozen=True)
class PrecisionReport:
    """``tfm precision``'s numbers: every activation (forward order), every activation's
    gradient (backward order) and every parameter's gradient, the output's next tokens, and
    the loss in both runs."""

    dtype: str
    eps: float
    threshold: float                  # in eps
    activations: list[TensorError]
    gradients: list[TensorError]
    parameters: list[TensorError]
    positions: list[Position]
    loss: float                       # float64's
    low_loss: float                   # the dtype's

    def first(self, errors: list[TensorError]) -> TensorError | None:
        """The first of ``errors`` past the threshold, or None. dprobs is passed over: it is
        off the backward's path (the loss's gradient reaches the logits directly)."""
        return next((e for e in errors if e.crosses(self.threshold) and e.name != "dprobs"),
                    None)

    @property
    def flips(self) -> list[Position]:
        return [p for p in self.positions if p.flipped]

    @property
    def consistent(self) -> bool:
        """Every tensor's error within its own plus its inherited (the triangle inequality,
        to float64's rounding of the three differences): the split adds up."""
        return all(not math.isfinite(e.rms) or e.rms <= (e.own + e.inherited) * (1 + 1e-9)
                   for e in self.activations + self.gradients + self.parameters)

    def stream(self, layers: int) -> list[tuple[str, TensorError]]:
        """The residual stream's error at each block's input, then the last block's output:
        what the picture of its growth draws."""
        by_name = {e.name: e for e in self.activations}
        names = [f"blocks.{i}.in" for i in range(layers)] + [f"blocks.{layers - 1}.out"]
        return [(name, by_name[name]) for name in names]

    def to_dict(self) -> dict:
        first = self.first(self.activations)
        first_grad = self.first(self.gradients)
        return {
            "dtype": self.dtype, "eps": self.eps, "threshold_eps": self.threshold,
            "first_activation_past_threshold": first.name if first else None,
            "first_gradient_past_threshold": first_grad.name if first_grad else None,
            "loss": {"float64": self.loss, self.dtype: self.low_loss},
            "activations": [e.to_dict() for e in self.activations],
            "gradients": [e.to_dict() for e in self.gradients],
            "parameter_gradients": [e.to_dict() for e in self.parameters],
            "positions": [{"row": p.row, "position": p.position, "float64": p.truth,
                           self.dtype: p.low, "flipped": p.flipped, "gap_eps": p.gap,
                           "noise_eps": p.noise, "near_tie": p.near_tie, "kl": _number(p.kl)}
                          for p in self.positions],
        }


def measure(name: str, kind: str, low, truth, made, eps: float, tiny: float,
            floor: float | None = None) -> TensorError:
    """``low``'s error against ``truth`` and its split at ``made`` (the operation on rounded
    float64 inputs); ``floor``: the scale of a tensor that is 0 but for rounding."""
    t, lo, m = (np.asarray(a, dtype=np.float64) for a in (truth, low, made))
    finite = np.isfinite(t)
    t_f, lo_f, m_f = t[finite], lo[finite], m[finite]
    rms64 = float(np.sqrt(np.mean(t_f * t_f))) if t_f.size else 0.0
    zero = floor is not None and rms64 <= ZERO * floor
    scale = (floor if zero else rms64) or 1.0
    with np.errstate(all="ignore"):   # the same inf on both sides: no difference (not NaN)
        diff, own, inherited = (np.where(a == b, 0.0, a - b)
                                for a, b in ((lo_f, t_f), (m_f, t_f), (lo_f, m_f)))

        def rms(d):
            return float(np.sqrt(np.mean(d * d))) / scale if d.size else 0.0

        largest = float(np.abs(diff).max()) / scale if diff.size else 0.0
        small = (np.abs(lo) < tiny) & (t != 0) & finite
    return TensorError(
        name, kind, tuple(t.shape), scale, rms(diff), largest if not np.isnan(diff).any()
        else math.nan, rms(own), rms(inherited), int((np.isinf(lo) & finite).sum()),
        int((np.isnan(lo) & ~np.isnan(t)).sum()), int(small.sum()), eps, zero)


def next_tokens(truth_logits, low_logits, inputs: Inputs, eps: float) -> list[Position]:
    """Each real position's most likely next token in both runs, float64's top-two gap in eps
    of their size, the low run's error in a difference of two logits there (in the same
    eps), and the KL divergence of the two next-token distributions (both made from the
    logits in float64)."""
    truth_logits = np.asarray(truth_logits, dtype=np.float64)
    low_logits = np.asarray(low_logits, dtype=np.float64)
    B, T = inputs.tokens.shape
    real = padding_mask(inputs.lengths, T)
    with np.errstate(all="ignore"):
        log_p = _log_softmax(truth_logits)
        log_q = _log_softmax(low_logits)
        kl = np.where(np.exp(log_p) > 0, np.exp(log_p) * (log_p - log_q), 0.0).sum(axis=-1)
        error = low_logits - truth_logits
        noise = np.sqrt(2 * np.mean(np.where(np.isfinite(error), error, 0.0) ** 2, axis=-1))
    top_two = np.sort(truth_logits, axis=-1)[..., -2:] if truth_logits.shape[-1] > 1 else None
    positions = []
    for b, t in zip(*np.nonzero(real)):
        size = 0.0
        if top_two is not None:
            second, first = top_two[b, t]
            size = max(abs(first), abs(second)) * eps
        gap = (first - second) / size if size > 0 else math.inf
        low = low_logits[b, t]
        positions.append(Position(int(b), int(t), int(np.argmax(truth_logits[b, t])),
                                  int(np.argmax(np.where(np.isnan(low), -np.inf, low))),
                                  float(gap), float(kl[b, t]),
                                  float(noise[b, t] / size) if size > 0 else 0.0))
    return positions


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def held_against_float64(params: dict, inputs: Inputs, cfg: Config, dtype: str,
                         threshold: float = 4.0, truth=None, truth_grads=None
                         ) -> PrecisionReport:
    """The run of ``params`` (float64, as ``cfg`` says) on ``inputs`` in ``dtype`` against
    float64, with each tensor's own and inherited error (the module docstring). ``truth``,
    ``truth_grads``: the float64 run's forward and backward, when made already.

    Parameters
    ----------
    params : dict of float64 arrays
    cfg : Config in float64
    dtype : {"float32", "float16", "bfloat16"}
    threshold : float
        In eps: the report names the first activation and gradient whose error passes it.
    """
    if cfg.dtype != "float64":
        raise ValueError(f"held_against_float64: cfg.dtype is {cfg.dtype}; the truth is "
                         f"float64's run")
    policy = precision.of(dtype)
    low_cfg = cfg.replace(dtype=dtype)
    # the weights as the dtype holds them, each rounded once from float64
    low_params = {name: policy.round(value).astype(low_cfg.np_dtype, copy=False)
                  for name, value in params.items()}
    if truth is None:
        truth = forward(params, inputs, cfg, fast=False)
        truth_grads = backward(params, truth, cfg)
    with np.errstate(all="ignore"):   # an overflow is counted here, not refused
        low = forward(low_params, inputs, low_cfg)
        low_grads = backward(low_params, low, low_cfg)
        forcing = Forcing(truth, truth_grads, policy, inputs.lengths)
        own = unchecked_forward(low_params, inputs, low_cfg, fast=False, plan=forcing)
        own_grads = backward(low_params, own, low_cfg)
    finfo = policy.finfo
    eps, tiny = float(finfo.eps), float(finfo.tiny)
    largest = max((_rms(g) for g in [*truth_grads.values(), *truth_grads.acts.values()]),
                  default=0.0)
    made = {**own.acts, **forcing.made}   # probs, not kept by the plan: the forced logits'
    activations = [measure(name, "activation", low.acts[name], truth.acts[name], made[name],
                           eps, tiny) for name in truth.acts]
    gradients = [measure("d" + name, "gradient", low_grads.acts[name], truth_grads.acts[name],
                         own_grads.acts[name], eps, tiny, largest)
                 for name in reversed(truth_grads.acts)]
    parameters = [measure("grad " + name, "parameter gradient", low_grads[name],
                          truth_grads[name], own_grads[name], eps, tiny, largest)
                  for name in truth_grads]
    positions = next_tokens(truth.acts["logits"], low.acts["logits"], inputs, eps)
    return PrecisionReport(dtype, eps, threshold, activations, gradients, parameters,
                           positions, truth.loss, low.loss)


def _rms(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.sqrt(np.mean(x * x))) if x.size else 0.0

