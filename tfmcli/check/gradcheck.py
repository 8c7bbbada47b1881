"""Central differences: the hand-written backward, checked one parameter entry at a time."""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # NumPy and the model load when a check runs: `import tfmcli` stays light
    from tfmcli.engine.config import Config
    from tfmcli.engine.inputs import Inputs

TOLERANCE = {"float64": 1e-6, "float32": 1e-3}
FLOOR = 1e-3  # errors are measured against at least this fraction of the largest gradient


def tolerance_for(cfg, tolerance: float | None = None) -> float:
    """``tolerance``, or the dtype's own (TOLERANCE); a ConfigError for a rounded dtype, whose
    loss moves in steps of its eps."""
    if cfg.dtype not in TOLERANCE:
        from tfmcli.errors import ConfigError

        raise ConfigError("dtype", f"gradcheck: central differences need float64 or "
                          f"float32, not {cfg.dtype}: a {cfg.dtype} loss moves in steps of "
                          f"its eps, so a difference of two of them over 2h says nothing of "
                          f"the slope; check the float64 run, or see what {cfg.dtype} "
                          f"changes with tfm precision")
    return TOLERANCE[cfg.dtype] if tolerance is None else tolerance


@dataclass
class ParamCheck:
    """One parameter's check.

    ``rel_err`` is ``max |analytic - numeric|`` over the checked entries divided by the largest
    magnitude of either in this tensor, or by a floor when that is bigger: ``FLOOR`` times the
    largest gradient of the whole model, or the smallest gradient central differences can
    resolve to 1e-6, ``eps_float64 * max(1, |loss|) / step / 1e-6`` (about 2e-5 |loss|). Some
    gradients (``b_K``) are exactly zero in exact arithmetic, and dividing rounding noise by zero
    says nothing.
    """

    name: str
    shape: tuple[int, ...]
    checked: int
    max_abs_err: float
    rel_err: float
    passed: bool


@dataclass
class GradcheckReport:
    params: list[ParamCheck]
    tolerance: float
    step: float
    dtype: str
    floor: float = 0.0   # the least denominator of rel_err (ParamCheck): the larger floor
    floor_rule: str = ""  # which floor it is: "1e-3 x the largest gradient" or "resolution"
    failed: list[str] = field(init=False)

    def __post_init__(self):
        self.failed = [c.name for c in self.params if not c.passed]

    def __repr__(self) -> str:
        """One line, as a notebook shows it: the verdict, the worst tensor, what was checked."""
        worst = self.worst if self.params else None
        return (f"GradcheckReport(passed={self.passed}, "
                + (f"worst={worst.name!r} rel_err={worst.rel_err:.2e}, " if worst else "")
                + f"tolerance={self.tolerance:g}, checked {self.checked:,} of "
                  f"{self.entries:,} entries in {len(self.params)} tensors"
                + (f", failed={self.failed}" if self.failed else "") + ")")

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def checked(self) -> int:
        """Entries compared with central differences, over every tensor checked."""
        return sum(c.checked for c in self.params)

    @property
    def entries(self) -> int:
        """Entries of the tensors checked (``checked`` is fewer when they were sampled)."""
        return sum(math.prod(c.shape) for c in self.params)

    @property
    def worst(self) -> ParamCheck:
        return max(self.params, key=lambda c: c.rel_err)


def gradcheck(
    params: dict,
    inputs: Inputs,
    cfg: Config,
    *,
    step: float = 1e-5,
    tolerance: float | None = None,
    max_entries: int | None = None,
    names: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    interventions=(),
) -> GradcheckReport:
    """Compare ``backward`` with central differences, parameter by parameter.

    The analytic gradient is computed in ``cfg.dtype``; the numeric one always in float64
    (``(L(p + h) - L(p - h)) / 2h``), since differences in float32 are mostly rounding.

    Parameters
    ----------
    step : float
        The finite-difference step h.
    tolerance : float, optional
        Largest ``rel_err`` that passes; 1e-6 for float64 runs, 1e-3 for float32.
    max_entries : int, optional
        Check at most this many entries of each tensor, sampled with ``default_rng(cfg.seed)``;
        ``None`` checks every entry.
    names : list of str, optional
        Check only these parameters.
    progress : callable(done, total), optional
        Called after every entry, for a progress bar.
    interventions : as ``forward``'s: every pass, nudged or not, makes the same changes (a
        mean ablation's means those of the unnudged pass: constants, as in the backward).
    """
    import numpy as np

    from tfmcli.engine.model import backward, forward, unchecked_forward

    tolerance = tolerance_for(cfg, tolerance)
    fwd = forward(params, inputs, cfg, interventions=interventions)   # checks the arguments
    analytic = backward(params, fwd, cfg)
    inputs = fwd.inputs
    scale = max(float(np.abs(g).max()) for g in analytic.values())
    # The smallest gradient central differences resolve to 1e-6: the rounding noise of
    # (L(p+h) - L(p-h)) / 2h over 1e-6. (All gradients can be 0: d_model = 1 makes LN constant.)
    noise = float(np.finfo(np.float64).eps) * max(1.0, abs(fwd.loss)) / step
    resolution = noise / TOLERANCE["float64"]
    floor = max(FLOOR * scale, resolution)
    cfg64 = cfg.replace(dtype="float64")
    work = {name: value.astype(np.float64) for name, value in params.items()}
    rng = np.random.default_rng(cfg.seed)

    names = list(params) if names is None else names
    picks = {}
    for name in names:
        size = params[name].size
        if max_entries is None or size <= max_entries:
            picks[name] = np.arange(size)
        else:
            picks[name] = np.sort(rng.choice(size, max_entries, replace=False))
    total, done = sum(len(p) for p in picks.values()), 0

    # A parameter of block i changes nothing before it: each nudged pass starts there, from
    # the block's input in a pass of the parameters as they are (the same loss, bit for bit).
    # GPT-2 small: a pass for a parameter of block i runs 12 - i blocks, not 12.
    plan = fwd.caches.get("plan")
    acts = unchecked_forward(work, inputs, cfg64, plan=plan).acts
    checks = []
    for name in names:
        flat = work[name].reshape(-1)  # a view: nudging it nudges the parameter
        start = first_block(name, cfg)
        x = None if start == 0 else acts[block_input(start, cfg)]
        numeric = np.empty(len(picks[name]))
        for j, index in enumerate(picks[name]):
            original = flat[index]
            flat[index] = original + step
            plus = unchecked_forward(work, inputs, cfg64, start=start, x=x, plan=plan).loss
            flat[index] = original - step
            minus = unchecked_forward(work, inputs, cfg64, start=start, x=x, plan=plan).loss
            flat[index] = original
            numeric[j] = (plus - minus) / (2 * step)
            done += 1
            if progress is not None:
                progress(done, total)
        exact = analytic[name].reshape(-1)[picks[name]].astype(np.float64)
        abs_err = float(np.abs(exact - numeric).max())
        size = max(float(np.abs(exact).max()), float(np.abs(numeric).max()), floor)
        rel = abs_err / size if size > 0 else 0.0
        checks.append(ParamCheck(name, params[name].shape, len(picks[name]), abs_err,
                                 float(rel), bool(rel <= tolerance)))
    rule = (f"{FLOOR:g} x the model's largest |gradient|" if FLOOR * scale >= resolution
            else "the smallest gradient central differences resolve")
    return GradcheckReport(checks, tolerance, step, cfg.dtype, floor, rule)


def directional_check(
    params: dict,
    inputs: Inputs,
    cfg: Config,
    *,
    directions: int = 4,
    step: float = 1e-5,
    tolerance: float | None = None,
    names: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    interventions=(),
    stream: bool = False,
) -> GradcheckReport:
    """Compare ``backward`` with central differences along random directions: for each
    parameter tensor, ``directions`` unit vectors v (drawn from ``default_rng(cfg.seed)``) and
    ``(L(p + h v) - L(p - h v)) / 2h`` against ``g . v``, every entry of the tensor taking
    part. Two passes a direction instead of two an entry: GPT-2 small's every tensor at a cost
    of ``2 x directions x tensors`` passes.

    A tensor's ``rel_err`` is ``max |g . v - numeric|`` over its directions divided by the
    size ``g . v`` has along a random unit v, ``|g| / sqrt(n)`` for a tensor of n entries (so a
    gradient off by a fraction e shows an error of about e, as entry by entry), or by a floor
    when that is bigger: ``FLOOR`` times the largest such size of any tensor, or the resolution
    of the differences (b_K's gradient is 0); ``checked`` counts the tensor's entries (all of
    them take part).

    ``stream``: a block at a time (``streamed_directional_check``), the same numbers.
    """
    import numpy as np

    from tfmcli.engine.model import backward, forward, unchecked_forward

    if stream:
        return streamed_directional_check(params, inputs, cfg, directions, step, tolerance,
                                          names, progress, interventions)
    tolerance = tolerance_for(cfg, tolerance)
    fwd = forward(params, inputs, cfg, interventions=interventions)
    analytic = backward(params, fwd, cfg)
    inputs = fwd.inputs
    typical = {name: float(np.linalg.norm(g.astype(np.float64))) / math.sqrt(max(g.size, 1))
               for name, g in analytic.items()}   # the size of g . v, v a random unit vector
    noise = float(np.finfo(np.float64).eps) * max(1.0, abs(fwd.loss)) / step
    floor = max(FLOOR * max(typical.values()), noise / TOLERANCE["float64"])
    cfg64 = cfg.replace(dtype="float64")
    work = {name: value.astype(np.float64) for name, value in params.items()}
    rng = np.random.default_rng(cfg.seed)
    names = list(params) if names is None else names
    plan = fwd.caches.get("plan")
    acts = unchecked_forward(work, inputs, cfg64, plan=plan).acts
    total, done, checks = len(names) * directions, 0, []
    for name in names:
        start = first_block(name, cfg)
        x = None if start == 0 else acts[block_input(start, cfg)]
        original = work[name].copy()
        g = analytic[name].astype(np.float64)
        worst = 0.0
        for _ in range(directions):
            v = rng.standard_normal(original.shape)
            v /= np.linalg.norm(v)
            work[name] = original + step * v
            plus = unchecked_forward(work, inputs, cfg64, start=start, x=x, plan=plan).loss
            work[name] = original - step * v
            minus = unchecked_forward(work, inputs, cfg64, start=start, x=x, plan=plan).loss
            numeric = (plus - minus) / (2 * step)
            worst = max(worst, abs(float((g * v).sum()) - numeric))
            done += 1
            if progress is not None:
                progress(done, total)
        work[name] = original
        size = max(typical[name], floor)
        rel = worst / size if size > 0 else 0.0
        checks.append(ParamCheck(name, params[name].shape, int(original.size), worst, float(rel),
                                 bool(rel <= tolerance)))
    rule = (f"{FLOOR:g} x the largest |g| / sqrt(n) of any tensor"
            if FLOOR * max(typical.values()) >= noise / TOLERANCE["float64"]
            else "the smallest gradient central differences resolve")
    return GradcheckReport(checks, tolerance, step, cfg.dtype, floor, rule)


def streamed_directional_check(params, inputs, cfg, directions, step, tolerance=None,
                               names=None, progress=None, interventions=()) -> GradcheckReport:
    """``directional_check`` holding one block at a time: the passes streamed
    (``model.forward(keep=...)``), the weights read (and widened to float64) when used, and
    each tensor checked as soon as the backward makes its gradient, which is then dropped.
    Its directions are the whole check's (the generator's state at each tensor's first draw,
    found by drawing them once in the whole check's order), so every number is the whole
    check's, bit for bit."""
    import numpy as np

    from tfmcli.engine.model import backward, forward, unchecked_forward

    tolerance = tolerance_for(cfg, tolerance)
    fwd = forward(params, inputs, cfg, interventions=interventions, keep=set())
    inputs, plan = fwd.inputs, fwd.caches.get("plan")
    noise = float(np.finfo(np.float64).eps) * max(1.0, abs(fwd.loss)) / step
    cfg64 = cfg.replace(dtype="float64")
    work = Widened(params)
    acts = unchecked_forward(work, inputs, cfg64, plan=plan, keep=set()).acts
    names = list(params) if names is None else names
    shapes = {name: Widened.shape(params, name) for name in params}
    rng, starts = np.random.default_rng(cfg.seed), {}
    for name in names:   # where each tensor's directions begin in the whole check's draws
        starts[name] = rng.bit_generator.state
        for _ in range(directions):
            rng.standard_normal(shapes[name])
    typical, worst, done = {}, {}, [0]

    def check(kind, name, arrays):   # each gradient as the backward makes it
        if kind != "grad":
            return None
        g = arrays[name].astype(np.float64)
        typical[name] = float(np.linalg.norm(g)) / math.sqrt(max(g.size, 1))
        if name not in starts:
            return None
        start = first_block(name, cfg)
        x = None if start == 0 else acts[block_input(start, cfg)]
        original, draws = work[name], np.random.default_rng()
        draws.bit_generator.state = starts[name]
        worst[name] = 0.0
        for _ in range(directions):
            v = draws.standard_normal(original.shape)
            v /= np.linalg.norm(v)
            loss = [unchecked_forward(ChainMap({name: original + sign * step * v}, work),
                                      inputs, cfg64, start=start, x=x, plan=plan,
                                      keep=set()).loss for sign in (1, -1)]
            numeric = (loss[0] - loss[1]) / (2 * step)
            worst[name] = max(worst[name], abs(float((g * v).sum()) - numeric))
            done[0] += 1
            if progress is not None:
                progress(done[0], len(names) * directions)
        return None

    backward(params, fwd, cfg, keep=set(), seen=check)
    floor = max(FLOOR * max(typical.values()), noise / TOLERANCE["float64"])
    checks = []
    for name in names:
        size = max(typical[name], floor)
        rel = worst[name] / size if size > 0 else 0.0
        checks.append(ParamCheck(name, shapes[name], math.prod(shapes[name]), worst[name],
                                 float(rel), bool(rel <= tolerance)))
    rule = (f"{FLOOR:g} x the largest |g| / sqrt(n) of any tensor"
            if FLOOR * max(typical.values()) >= noise / TOLERANCE["float64"]
            else "the smallest gradient central differences resolve")
    return GradcheckReport(checks, tolerance, step, cfg.dtype, floor, rule)


class Widened(Mapping):
    """Parameters in float64, each widened when it is read (a copy), never all at once."""

    def __init__(self, params):
        self.params = params

    def __getitem__(self, name):
        return self.params[name].astype("float64")

    def __contains__(self, name) -> bool:
        return name in self.params

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    @staticmethod
    def shape(params, name) -> tuple:
        """A parameter's shape without reading it (a checkpoint's read when used)."""
        return tuple(params.meta(name)[0] if hasattr(params, "meta") else params[name].shape)


def first_block(name: str, cfg: "Config") -> int:
    """The first block a parameter's value reaches: its own block's, ``cfg.layers`` for the
    final norm's and the head's (after every block), 0 for the embedding's (the tied head's
    W_E included) and the embedding norm's."""
    if name.startswith("blocks."):
        return int(name.split(".")[1])
    if name.startswith(("ln_f.", "head.")):
        return cfg.layers
    return 0


def block_input(block: int, cfg: "Config") -> str:
    """The activation that is block ``block``'s input: the last block's output past the last."""
    return f"blocks.{block}.in" if block < cfg.layers else f"blocks.{cfg.layers - 1}.out"


def central_differences(f: Callable, x, step: float = 1e-6):
    """The gradient of the scalar function ``f`` at the vector ``x`` (float64) by central
    differences, each entry's step relative to it (``step * max(1, |x_j|)``): the check that
    ``tfm ln``, ``tfm block``, ``tfm embed`` and ``tfm attn --query --backward`` print beside
    the formula they lay out (``tfm ffn`` and ``tfm loss``: ``batched_central_differences``)."""
    import numpy as np

    grad = np.empty(x.size)
    for j in range(x.size):
        h = step * max(1.0, abs(x[j]))
        up, down = x.copy(), x.copy()
        up[j] += h
        down[j] -= h
        grad[j] = (f(up) - f(down)) / (2 * h)
    return grad


def batched_central_differences(moved: Callable, x, step: float = 1e-6, batch: int = 64):
    """``central_differences`` with the points taken ``batch`` entries at a time:
    ``moved(js, hs)`` gives f at ``x + hs[i] e_js[i]`` for each i, as an array. A function
    whose first step is linear, ``y = x A + c``, moves y by ``h A[j]``: a row of A for each
    point instead of a product, and one product of a batch for what follows. ``tfm loss`` on
    GPT-2 small made 1,536 products of a row by the (768, 50257) head, 16 s; ``tfm ffn`` 1,536
    of a row through the FFN, 4 s. Each step is ``step * max(1, |x_j|)``, as there."""
    import numpy as np

    steps = step * np.maximum(1.0, np.abs(x))
    grad = np.empty(x.size)
    for start in range(0, x.size, batch):
        js = np.arange(start, min(start + batch, x.size))
        h = steps[js]
        grad[js] = (moved(js, h) - moved(js, -h)) / (2 * h)
    return grad
