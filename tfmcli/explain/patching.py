"""Activation patching and its first-order estimate, attribution patching (``tfm patch``).

A clean run and a corrupted one (the same model on other tokens, the same shapes). For each
component (a head, a block's attention or FFN output, a position of an activation), the real
effect of patching it: the metric of the corrupted run with that component's clean values
patched in, minus the metric of the corrupted run. Beside it, attribution patching's estimate:
the metric's gradient at the corrupted run dotted with clean minus corrupted over the
component's entries (one backward pass for every component). The metric is the loss (against
the clean run's targets) or a logit difference (the answer's logit minus the wrong token's at
each row's last real position, the mean over the rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfmcli.engine.inputs import Inputs
from tfmcli.engine.interventions import InterventionError, Patch, resolve
from tfmcli.engine.model import backward, forward
from tfmcli.engine.sizes import activation_shapes

OVER = ("heads", "sublayers", "positions")
METRICS = ("loss", "logit-diff")


@dataclass
class PatchingGrid:
    """Both grids, rows x columns: ``real`` (the metric's change when the component is patched
    in) and ``estimate`` (attribution patching's), the targets patched, the two runs' metrics."""

    over: str
    metric: str
    rows: list[str]
    cols: list[str]
    targets: list[list[str]]
    clean: float
    corrupted: float
    real: np.ndarray
    estimate: np.ndarray

    @property
    def difference(self) -> np.ndarray:
        """estimate - real: what the first-order estimate misses."""
        return self.estimate - self.real

    @property
    def rank_correlation(self) -> float:
        """Spearman's: how well the estimate ranks the components by their real effect (1:
        the same order)."""
        return spearman(self.real.ravel(), self.estimate.ravel())


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """The correlation of the ranks (ties by average rank); nan when either is constant."""
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for value in np.unique(x):   # ties share their mean rank
        same = x == value
        ranks[same] = ranks[same].mean()
    return ranks


def components(cfg, over: str, act: str | None = None, tokens=None):
    """(row labels, column labels, targets): every head (blocks down, heads across), every
    block's attention and FFN output, or every position of ``act`` (default: every block's
    input, blocks down)."""
    L, H = cfg.layers, cfg.heads
    if over == "heads":
        return ([f"block {i}" for i in range(L)], [f"head {h}" for h in range(H)],
                [[f"blocks.{i}.attn.head{h}" for h in range(H)] for i in range(L)])
    if over == "sublayers":
        return ([f"block {i}" for i in range(L)], ["attn", "ffn"],
                [[f"blocks.{i}.attn.out", f"blocks.{i}.ffn.out"] for i in range(L)])
    T = cfg.seq_len
    labels = [f"t{t}" if tokens is None else f"{t}:{tokens[t]}" for t in range(T)]
    names = [f"blocks.{i}.in" for i in range(L)] if act is None else [act]
    return (names, labels, [[f"{name}[:, {t}]" for t in range(T)] for name in names])


def metric_of(fwd, metric: str, answer=None, wrong=None) -> float:
    """The metric of a run: its loss, or the mean over rows of the answer's logit minus the
    wrong token's at the row's last real position."""
    if metric == "loss":
        return float(fwd.loss)
    logits = fwd.acts["logits"]
    last = fwd.inputs.lengths - 1
    rows = np.arange(len(last))
    return float((logits[rows, last, answer] - logits[rows, last, wrong]).mean())


def metric_dlogits(fwd, metric: str, answer=None, wrong=None):
    """The metric's gradient with respect to the logits (None: the loss's, the backward's own)."""
    if metric == "loss":
        return None
    logits = fwd.acts["logits"]
    d = np.zeros_like(logits)
    last = fwd.inputs.lengths - 1
    rows = np.arange(len(last))
    d[rows, last, answer] += 1.0 / len(last)
    d[rows, last, wrong] -= 1.0 / len(last)
    return d


def paired(clean: Inputs, corrupted: Inputs, metric: str, answer=None, wrong=None) -> Inputs:
    """The corrupted run scored as the clean one (its targets), once the two are a pair: the
    same shapes and lengths (InterventionError), a known metric, logit-diff's two tokens."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; one of {', '.join(METRICS)}")
    if metric == "logit-diff" and (answer is None or wrong is None):
        raise ValueError("metric='logit-diff' needs answer and wrong token ids")
    if clean.tokens.shape != corrupted.tokens.shape or not np.array_equal(clean.lengths,
                                                                          corrupted.lengths):
        raise InterventionError("corrupted", "the corrupted rows must have the clean rows' "
                                f"lengths: {clean.lengths.tolist()} clean, "
                                f"{corrupted.lengths.tolist()} corrupted")
    return Inputs(corrupted.tokens, clean.targets, clean.lengths)


def patching(params, clean: Inputs, corrupted: Inputs, cfg, over: str = "heads",
             metric: str = "loss", answer: int | None = None, wrong: int | None = None,
             act: str | None = None, tokens=None, progress=None) -> PatchingGrid:
    """Activation patching of every component (``components``) from the clean run into the
    corrupted one, and attribution patching's estimate of each; ``PatchingGrid``.

    ``clean`` and ``corrupted`` must have the same shapes and lengths; the loss is taken
    against the clean run's targets. ``metric="logit-diff"`` needs ``answer`` and ``wrong``
    token ids. ``progress(done, total)`` is called after each patched run."""
    if over not in OVER:
        raise ValueError(f"over={over!r}; one of {', '.join(OVER)}")
    corrupted = paired(clean, corrupted, metric, answer, wrong)
    rows, cols, targets = components(cfg, over, act, tokens)
    clean_fwd = forward(params, clean, cfg)
    base = forward(params, corrupted, cfg)
    grads = backward(params, base, cfg, metric_dlogits(base, metric, answer, wrong)).acts
    shapes = activation_shapes(cfg)
    base_metric = metric_of(base, metric, answer, wrong)
    real, estimate = np.zeros((len(rows), len(cols))), np.zeros((len(rows), len(cols)))
    total, done = real.size, 0
    for r, line in enumerate(targets):
        for c, target in enumerate(line):
            name, index_base, index = resolve(target, shapes)
            delta = clean_fwd.acts[name] - base.acts[name]
            g = grads[name]
            part = (lambda x: x[index_base][index]) if index_base else (lambda x: x[index])
            estimate[r, c] = float((part(g) * part(delta)).sum())
            patched = forward(params, corrupted, cfg, interventions=[Patch(target, clean_fwd)])
            real[r, c] = metric_of(patched, metric, answer, wrong) - base_metric
            done += 1
            if progress is not None:
                progress(done, total)
    return PatchingGrid(over, metric, rows, cols, targets,
                        metric_of(clean_fwd, metric, answer, wrong), base_metric, real, estimate)
