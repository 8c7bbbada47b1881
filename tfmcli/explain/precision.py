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

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tfmcli.engine import precision
from tfmcli.engine.config import Config
from tfmcli.engine.inputs import Inputs
from tfmcli.engine.masks import padding_mask

ZERO = 1e-10   # a gradient whose float64 RMS is below this fraction of the largest is 0 but for
#                float64's rounding (b_K's: a shift of every key leaves each softmax as it was)
NEAR_TIE = 3.0   # top two logits closer than this many times the run's error in a difference of
#                  two logits there: a flip another rounding order may make or not (a near tie)


class Forcing:
    """A pass's plan (the interface of ``engine.interventions.Plan``) that keeps, as each
    activation and gradient is made, what the operation made (``made``; the gradients are the
    pass's own ``dacts``) and hands on the float64 run's instead, rounded to the dtype: each
    operation after it reads float64's inputs as the dtype holds them. ``truth`` and
    ``truth_grads``: the float64 run's activations and activation gradients by name (its
    Tape's, filled as the runs go in step); ``names``: every activation the pass keeps."""

    def __init__(self, names, truth: dict, truth_grads: dict, policy: precision.Precision,
                 lengths):
        self.truth, self.truth_grads, self.policy = truth, truth_grads, policy
        self.steps = dict.fromkeys(names, ())   # every kept activation (attention by parts)
        self.lengths = np.asarray(lengths)
        self.interventions = ()
        self.made: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return True

    def apply(self, name: str, x: np.ndarray) -> np.ndarray:
        self.made[name] = x
        return self._rounded(self.truth[name])

    def through(self, name: str, dx: np.ndarray) -> np.ndarray:
        return self._rounded(self.truth_grads[name])

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
        of two logits (or tie exactly): a run rounding in another order (another kernel,
        torch's) may flip here or not. A flip past it is one every run in the dtype makes."""
        return self.gap == 0 or self.gap < NEAR_TIE * self.noise


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
    truth: object = field(default=None, repr=False, compare=False)   # float64's Forward
    truth_grads: object = field(default=None, repr=False, compare=False)   # and Gradients
    #                                   (a whole comparison's; a streamed one keeps neither)
    names: tuple = ("float64", None)   # the two runs' names in --json (None: the dtype)

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
        truth, low = self.names[0], self.names[1] or self.dtype
        return {
            "dtype": self.dtype, "eps": self.eps, "threshold_eps": self.threshold,
            "first_activation_past_threshold": first.name if first else None,
            "first_gradient_past_threshold": first_grad.name if first_grad else None,
            "loss": {truth: self.loss, low: self.low_loss},
            "activations": [e.to_dict() for e in self.activations],
            "gradients": [e.to_dict() for e in self.gradients],
            "parameter_gradients": [e.to_dict() for e in self.parameters],
            "positions": [{"row": p.row, "position": p.position, truth: p.truth,
                           low: p.low, "flipped": p.flipped, "gap_eps": _number(p.gap),
                           "noise_eps": _number(p.noise), "near_tie": p.near_tie,
                           "kl": _number(p.kl)}
                          for p in self.positions],
        }


CHUNK = 1 << 20   # entries raw_error reads at a time: its scratch is a few of these


def raw_error(low, truth, made, tiny: float) -> dict:
    """What a tensor's error needs of the three arrays (``low``'s against ``truth``, split at
    ``made``: the operation on rounded float64 inputs), before any scale: float64's RMS over its
    finite entries, the RMS and largest of each difference there, and the counts. A streamed
    comparison keeps these and lets the arrays go (the gradients' scale, the largest
    gradient's RMS, is known only at the end). Read CHUNK entries at a time, so that a
    7B model's head (131 million entries) needs no float64 copies of the three."""
    flat = [np.asarray(a).reshape(-1) for a in (truth, low, made)]
    squares = np.zeros(4)   # float64's, then the differences': total, own, inherited
    largest, counts, entries = 0.0, np.zeros(3, dtype=np.int64), 0
    nan_diff = False
    for start in range(0, flat[0].size, CHUNK):
        t, lo, m = (np.asarray(a[start:start + CHUNK], dtype=np.float64) for a in flat)
        finite = np.isfinite(t)
        t_f, lo_f, m_f = t[finite], lo[finite], m[finite]
        with np.errstate(all="ignore"):   # the same inf on both sides: no difference (not NaN)
            diffs = [np.where(a == b, 0.0, a - b)
                     for a, b in ((lo_f, t_f), (m_f, t_f), (lo_f, m_f))]
            squares += [float(t_f @ t_f), *(float(d @ d) for d in diffs)]
            if diffs[0].size:
                nan_diff |= bool(np.isnan(diffs[0]).any())
                largest = max(largest, float(np.nanmax(np.abs(diffs[0]), initial=0.0)))
            counts += [int((np.isinf(lo) & finite).sum()), int((np.isnan(lo) & ~np.isnan(t)).sum()),
                       int(((np.abs(lo) < tiny) & (t != 0) & finite).sum())]
        entries += t_f.size
    with np.errstate(invalid="ignore"):
        rms64, rms, own, inherited = (float(np.sqrt(x / entries)) if entries else 0.0
                                      for x in squares)
    return {"shape": tuple(np.shape(truth)), "rms64": rms64, "rms": rms,
            "max": math.nan if nan_diff else largest, "own": own, "inherited": inherited,
            "inf": int(counts[0]), "nan": int(counts[1]), "flushed": int(counts[2])}


def finish(raw: dict, name: str, kind: str, eps: float, floor: float | None = None
           ) -> TensorError:
    """``raw_error``'s numbers over the tensor's scale: its float64 RMS, or ``floor`` for a
    tensor that is 0 but for rounding (its RMS at most ZERO of it)."""
    zero = floor is not None and raw["rms64"] <= ZERO * floor
    scale = (floor if zero else raw["rms64"]) or 1.0
    return TensorError(name, kind, raw["shape"], scale, raw["rms"] / scale, raw["max"] / scale,
                       raw["own"] / scale, raw["inherited"] / scale, raw["inf"], raw["nan"],
                       raw["flushed"], eps, zero)


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


def held_against_float64(params, inputs: Inputs, cfg: Config, dtype: str,
                         threshold: float = 4.0, stream: bool = False, progress=None,
                         low_params=None, unit: float | None = None, names=("float64", None)
                         ) -> PrecisionReport:
    """The run of ``params`` (float64, as ``cfg`` says) on ``inputs`` in ``dtype`` against
    float64, with each tensor's own and inherited error (the module docstring).

    The three runs go in step, a block at a time (``Runs``). With ``stream`` each block's
    activations, gradients and weights are let go once measured: a pass holds one block's
    (and reads its weights from their files once a pass: a 7B folder compared in a few GiB).
    Without, the float64 run stays whole: ``report.truth``, ``report.truth_grads``.

    Parameters
    ----------
    params : mapping of float64 arrays (a streamed run's may read each when used)
    cfg : Config in float64
    dtype : {"float32", "float16", "bfloat16"}
    threshold : float
        In eps: the report names the first activation and gradient whose error passes it.
    progress : callable(done, total), optional
        After each block of the forward and of the backward (a progress bar's).
    low_params : mapping of float64 arrays, optional
        The model run in the dtype, when it is not ``params`` (the quantization lens: a
        quantized file's weights, dequantized, against the original's in float64; ``dtype``
        may then be float64 itself, the weights' error alone).
    unit : float, optional
        What the errors are read in, instead of the dtype's eps (the lens in float64: the
        weights' own relative error). ``names``: the two runs' names in ``to_dict``.

    Raises ``TfmError`` when the float64 run overflows or makes a NaN: then there is no truth.
    """
    if cfg.dtype != "float64":
        raise ValueError(f"held_against_float64: cfg.dtype is {cfg.dtype}; the truth is "
                         f"float64's run")
    if dtype == "float64" and (low_params is None or unit is None):
        raise ValueError("held_against_float64: float64 against float64 compares another "
                         "model's weights (low_params), in a unit of their own (unit)")
    runs = Runs(params, inputs, cfg, dtype, stream, low_params)
    if unit is not None:
        runs.eps = float(unit)
    return dataclasses.replace(runs.report(threshold, progress), names=tuple(names))


class Runs:
    """float64's run (``truth``), the dtype's (``low``) and the dtype's own operations'
    (``own``, on float64's inputs rounded: ``Forcing``), made a step at a time in step, each
    step's tensors measured as soon as the three have made them."""

    ORDER = ("truth", "low", "own")

    def __init__(self, params, inputs: Inputs, cfg: Config, dtype: str, stream: bool,
                 low_params=None):
        from tfmcli.engine import blocks
        from tfmcli.engine.model import _block_masks
        from tfmcli.engine.sizes import activation_shapes

        self.inputs, self.cfg, self.stream = inputs, cfg, stream
        self.policy = policy = precision.of(dtype)
        self.low_cfg = low_cfg = cfg.replace(dtype=dtype)
        B, T = inputs.tokens.shape
        self.shape = (B, T)
        self.names = list(activation_shapes(cfg.replace(batch=B, seq_len=T)))
        self.params = HeldBlock(params) if stream else params
        other = self.params if low_params is None else (
            HeldBlock(low_params) if stream else low_params)
        # the weights as the dtype holds them, each rounded once from float64
        self.low_params = low = Rounded(other, policy, low_cfg.np_dtype)

        def tape(P, cfg, fast, plan=None):
            fast = fast and precision.of(cfg.dtype).exact   # rounded: the reference path
            caches = {"fast": fast, "cfg": cfg, **({"plan": plan} if plan else {})}
            return blocks.Tape(P, cfg, caches, _block_masks(cfg, inputs.lengths, T, fast,
                                                            range(cfg.layers)))

        truth = tape(self.params, cfg, True)
        self.forcing = Forcing(self.names, truth.acts, truth.dacts, policy, inputs.lengths)
        self.tapes = {"truth": truth, "low": tape(low, low_cfg, True),
                      "own": tape(low, low_cfg, False, self.forcing)}
        finfo = policy.finfo
        self.eps, self.tiny = float(finfo.eps), float(finfo.tiny)
        self.raw: dict[str, dict] = {}   # "activation" / "gradient" / "parameter gradient"
        self.kinds: dict[str, str] = {}
        self.report_: PrecisionReport | None = None   # (``compared``'s, once made)

    def step(self, run: str, work):
        """``work(tape)`` for one run, in its dtype's rounding and its engine; the float64
        run's overflow is refused (then nothing it says is right), the others' counted."""
        from tfmcli.engine.model import _engine
        from tfmcli.errors import TfmError

        t = self.tapes[run]
        with _engine(t.fast, t.cfg, *self.shape):
            if run != "truth":
                with np.errstate(all="ignore"):
                    return work(t)
            try:
                with np.errstate(over="raise", invalid="raise", divide="raise",
                                 under="ignore"):
                    return work(t)
            except FloatingPointError as e:
                raise TfmError(f"the float64 run overflowed ({e}): no truth to hold the run "
                               f"against; use smaller weights or inputs") from None

    def each(self, work, values):
        """``work(tape, value)`` for the three runs in turn (float64's first: the own run
        reads what it made), each with its own value; their results."""
        return {run: self.step(run, lambda t, v=values[run]: work(t, v)) for run in self.ORDER}

    # ------------------------------------------------------------ measuring

    def measure_acts(self) -> None:
        """Every activation the three have made and not yet measured."""
        truth, low, own = (self.tapes[r].acts for r in self.ORDER)
        for name in [n for n in truth if n not in self.raw]:
            made = self.forcing.made.get(name, own.get(name))   # probs: the forced logits'
            self.raw[name] = raw_error(low[name], truth[name], made, self.tiny)
            self.kinds[name] = "activation"
            if self.stream:
                self.forcing.made.pop(name, None)

    def measure_grads(self) -> None:
        """Every activation's and parameter's gradient the three have made and not yet
        measured."""
        tapes = [self.tapes[r] for r in self.ORDER]
        for kind, prefix, held in (("gradient", "d", "dacts"),
                                   ("parameter gradient", "grad ", "grads")):
            truth, low, own = (getattr(t, held) for t in tapes)
            for name in [n for n in truth if prefix + n not in self.raw]:
                if name not in low or name not in own:
                    continue
                self.raw[prefix + name] = raw_error(low[name], truth[name], own[name], self.tiny)
                self.kinds[prefix + name] = kind
                if self.stream and held == "grads":   # nothing reads a weight's gradient
                    for arrays in (truth, low, own):
                        del arrays[name]

    def let_go_of(self, names) -> None:
        """Streamed: these activations and their gradients, once measured."""
        if self.stream:
            for t in self.tapes.values():
                for arrays in (t.acts, t.dacts):
                    for name in names:
                        arrays.pop(name, None)

    def let_go(self, prefix: str, caches=()) -> None:
        """Streamed: the block's activations but its input, its gradients, caches and
        weights, once measured (``prefix`` "embed." or "head.": those weights, and
        ``caches``)."""
        if not self.stream:
            return
        keep = prefix + "in"
        for t in self.tapes.values():
            for arrays in (t.acts, t.dacts, t.grads):
                for name in [n for n in arrays if n.startswith(prefix) and n != keep]:
                    del arrays[name]
            for name in [n for n in t.caches if isinstance(n, str) and (
                    n.startswith(prefix) or n in caches)]:
                del t.caches[name]
        self.params.let_go(prefix)
        self.low_params.let_go(prefix)
        if self.low_params.params is not self.params:
            self.low_params.params.let_go(prefix)

    # ------------------------------------------------------------ the runs

    def report(self, threshold: float, progress=None) -> PrecisionReport:
        from tfmcli.engine import blocks, parallel
        from tfmcli.engine.model import _embed_forward, embed_backward, head_backward, head_forward

        cfg, inputs, L = self.cfg, self.inputs, self.cfg.layers
        total = 2 * L
        x = self.each(lambda t, _: _embed_forward(t, inputs), dict.fromkeys(self.ORDER))
        self.measure_acts()
        if not cfg.tied_head:   # W_E's rows are read: the head reads W_U
            self.let_go("embed.")
        for i in range(L):
            x = self.each(lambda t, v, i=i: blocks.block(t, v, i), x)
            self.measure_acts()
            if self.stream and i + 1 < L:   # the last block's the backward begins with
                self.let_go(f"blocks.{i}.")
            if progress is not None:
                progress(i + 1, total)
        losses = self.each(lambda t, v: head_forward(t, v, inputs), x)
        self.measure_acts()
        positions = next_tokens(self.tapes["truth"].acts["logits"],
                                self.tapes["low"].acts["logits"], inputs, self.eps)

        def deferred(work):
            def run(t, v):
                with parallel.deferred():
                    return work(t, v)
            return run

        back = self.each(deferred(lambda t, _: head_backward(t)), dict.fromkeys(self.ORDER))
        # tied, W_E's gradient is the head's and the embedding's: the head's waits for it
        dx, dW_U = {r: back[r][0] for r in back}, {r: back[r][1] if cfg.tied_head else None
                                                     for r in back}
        del back
        self.measure_grads()
        # the head is done: its weights, caches, the logits and probabilities (V wide) go;
        # tied, W_E's too (the embedding's backward adds its rows into dW_U alone)
        self.let_go("head.", caches=("head", "capped logits", "loss"))
        self.let_go_of(("logits", "probs"))
        if cfg.tied_head:
            self.let_go("embed.")
        for i in reversed(range(L)):
            p = f"blocks.{i}."
            if self.stream and i + 1 < L:   # made again from its input, as it was made
                kind = blocks.KINDS[blocks.kind(cfg)][0]
                self.each(lambda t, _, i=i, p=p: kind(t, t.acts[p + "in"], i),
                          dict.fromkeys(self.ORDER))
                self.forcing.made.clear()   # (measured the first time)
            dx = self.each(deferred(lambda t, v, i=i: blocks.block_backward(t, v, i)), dx)
            self.measure_grads()
            self.let_go(p)
            if progress is not None:
                progress(2 * L - i, total)
        if cfg.embed_norm:
            dx = self.each(deferred(lambda t, v: blocks.norm_backward(t, v, "ln_embed")), dx)
        params = {"truth": self.params, "low": self.low_params, "own": self.low_params}
        self.each(lambda t, v: embed_backward(t, *v), {r: (dx[r], dW_U[r], params[r])
                                                       for r in self.ORDER})
        self.measure_grads()
        return self.finish(threshold, positions, losses)

    def finish(self, threshold, positions, losses) -> PrecisionReport:
        """The errors over their scales, in the report's orders: the activations forward, their
        gradients backward, the parameters' as the parameters come."""
        largest = max((raw["rms64"] for name, raw in self.raw.items()
                       if self.kinds[name] != "activation"), default=0.0)
        errors = {name: finish(raw, name, self.kinds[name], self.eps,
                               None if self.kinds[name] == "activation" else largest)
                  for name, raw in self.raw.items()}
        order = [n for n in self.names if n in errors]
        truth = (None, None) if self.stream else self.truth_run(losses["truth"])
        return PrecisionReport(
            self.low_cfg.dtype, self.eps, threshold, [errors[n] for n in order],
            [errors["d" + n] for n in reversed(order) if "d" + n in errors],
            [errors["grad " + n] for n in self.params if "grad " + n in errors],
            positions, losses["truth"], losses["low"], *truth)

    def arrays(self, name: str, grad: bool):
        """Tensor ``name`` (its gradient with ``grad``) in the three runs of a whole
        comparison: float64's, the dtype's, and its own operation's on float64's inputs
        rounded (a weight's: the dtype's rounding, all its own)."""
        truth, low, own = (self.tapes[r] for r in self.ORDER)
        if name in self.params:
            if grad:
                return truth.grads[name], low.grads[name], own.grads[name]
            rounded = self.low_params[name]
            return self.params[name], rounded, rounded
        if grad:
            return truth.dacts[name], low.dacts[name], own.dacts[name]
        return truth.acts[name], low.acts[name], self.forcing.made.get(name, own.acts[name])

    def truth_run(self, loss):
        """float64's run as ``forward`` and ``backward`` return it (what --save writes)."""
        from collections import OrderedDict

        from tfmcli.engine.model import Forward, Gradients

        t = self.tapes["truth"]
        grads = Gradients({n: t.grads[n] for n in self.params if n in t.grads},
                          OrderedDict((n, t.dacts[n]) for n in t.acts if n in t.dacts))
        return Forward(loss, t.acts, self.inputs, t.caches), grads


def compared(params, inputs: Inputs, cfg: Config, dtype: str) -> "Runs":
    """The three runs of ``held_against_float64``, kept whole, with its report
    (``runs.report_``): each tensor's cells in float64, in the dtype, and made by its own
    operation (``Runs.arrays``), as the explorer shows them."""
    runs = Runs(params, inputs, cfg, dtype, stream=False)
    runs.report_ = runs.report(4.0)
    return runs


def cell_error(runs: "Runs", name: str, grad: bool, index: tuple) -> list[str]:
    """One cell of a compared run (``compared``) explained: its value in the dtype and in
    float64, the error, in the dtype's eps of the tensor's scale (``tfm precision``'s: its
    float64 RMS, or the largest gradient's for one that is 0 but for rounding), and its
    split into the operation's own and what its inputs' error brought; each line within 36
    columns."""
    from tfmcli.render.numbers import one

    truth, low, made = runs.arrays(name, grad)
    t, lo, m = (float(np.asarray(a, dtype=np.float64)[index]) for a in (truth, low, made))
    label = ("grad " if name in runs.params else "d") + name if grad else name
    measured = {e.name: e for e in (runs.report_.activations + runs.report_.gradients +
                                    runs.report_.parameters)} if runs.report_ else {}
    scale = measured[label].scale if label in measured else (_rms(truth) or 1.0)
    dtype = runs.low_cfg.dtype

    def minus(a: float, b: float) -> float:   # the same inf on both sides: no difference
        return 0.0 if a == b else a - b

    def eps(x: float) -> str:
        n = x / scale / runs.eps
        return "0 eps" if n == 0 else f"{n:+.2f} eps" if abs(n) < 10 else f"{n:+.3g} eps"

    error, own, inherited = minus(lo, t), minus(m, t), minus(lo, m)
    return [f"{dtype} - float64, this cell:",
            f"  {dtype:<10}{one(lo):>12}", f"  {'float64':<10}{one(t):>12}",
            f"  {'error':<10}{one(error):>12}  {eps(error)}",
            f"  {'own':<10}{one(own):>12}  {eps(own)}",
            f"  {'inherited':<10}{one(inherited):>12}  {eps(inherited)}",
            "eps: the dtype's, of the tensor's",
            f"  scale ({one(scale).strip()}, as tfm",
            "  precision's table reads it)",
            "own: its operation on float64's",
            "  inputs rounded; inherited: what",
            "  its inputs' error brought"]


class Held(Mapping):
    """Weights read through ``made`` (each made once, at its first read) and held until
    ``let_go``: the runs in step read each once between them, in each direction."""

    def __init__(self, params, made):
        self.params, self.made, self.held = params, made, {}

    def __getitem__(self, name):
        if name not in self.held:
            self.held[name] = self.made(self.params[name])
        return self.held[name]

    def let_go(self, prefix: str) -> None:
        for name in [n for n in self.held if n.startswith(prefix)]:
            del self.held[name]

    def __contains__(self, name):
        return name in self.params

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


class HeldBlock(Held):
    """A streamed run's weights in float64, each block's held from its first read until it
    is measured (the embedding's and the head's until used)."""

    def __init__(self, params):
        super().__init__(params, lambda value: np.asarray(value, dtype=np.float64))


class Rounded(Held):
    """The weights as the dtype holds them, each rounded from float64's at its first read:
    the dtype's run and its own operations' read the same copy."""

    def __init__(self, params, policy: precision.Precision, np_dtype):
        super().__init__(params, lambda value: policy.round(value).astype(np_dtype,
                                                                          copy=False))
        self.rounded = policy.name   # what a Tape reads as it is (``precision.stored``)


def _rms(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.sqrt(np.mean(x * x))) if x.size else 0.0
