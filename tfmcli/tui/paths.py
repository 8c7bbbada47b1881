"""A gradient entry as the sum of its paths: each term one way its number reaches the loss.

A parameter's gradient sums one term per position it was used at (``dW[i, j] = sum over b, t
of x[b, t, i] dy[b, t, j]``); an activation's sums one term per number it feeds (``dx[b, t, i]
= sum over j of W[i, j] dy[b, t, j]``, through each weight that reads it), or its two ways on
(a residual stream: the skip and the norm). Each rule writes its formula and its terms from the
run's own numbers; ``gradient_paths`` shows them only when they add up to the backward's
number, so a variant no rule was written for (a sandwich norm, a capped score) says so rather
than showing a sum that is not the gradient.

Its numbers are written as the explorer writes every column of numbers (``column``): at the
column's scale with four significant digits, so a gradient of 1.6e-06 is ``-1.600e-06``,
never ``-0.0000`` or a sum of ``-0.000002`` terms.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tfmcli.engine import ops
from tfmcli.engine.inputs import IGNORE
from tfmcli.render.numbers import FIXED_RANGE, ZERO_TO_PRECISION, fmt, negligible

TOP = 4   # terms listed one by one; the rest are summed in one line

# weight -> (the activations it may read, the one it makes), within one block
LINEAR = {"attn.W_Q": (("ln1.out", "in"), "attn.q"), "attn.W_K": (("ln1.out", "in"), "attn.k"),
          "attn.W_V": (("ln1.out", "in"), "attn.v"), "attn.W_O": (("attn.context",), "attn.out"),
          "ffn.W_gate": (("ln2.out", "ln1.out"), "ffn.gate"),
          "ffn.W_1": (("ln2.out", "ln1.out"), "ffn.pre"), "ffn.W_2": (("ffn.act",), "ffn.out")}
BIASES = {"attn.b_Q": "attn.q", "attn.b_K": "attn.k", "attn.b_V": "attn.v",
          "attn.b_O": "attn.out", "ffn.b_gate": "ffn.gate", "ffn.b_1": "ffn.pre",
          "ffn.b_2": "ffn.out"}
# activation -> the weights that read it, within one block
READERS = {"ln1.out": ("attn.W_Q", "attn.W_K", "attn.W_V", "ffn.W_gate", "ffn.W_1"),
           "ln2.out": ("ffn.W_gate", "ffn.W_1"), "attn.context": ("attn.W_O",),
           "ffn.act": ("ffn.W_2",)}


DIGITS = 4   # significant digits of a column's largest number
EPS = float(np.finfo(np.float64).eps)


def column(values, eps: float = EPS, floor: float = 0.0) -> Callable[[float], str]:
    """How each number of a column is written: at the column's scale (its largest finite
    |value|) with four significant digits, in one notation (fixed point when the scale is in
    the CLI's fixed range, ``+0.1234``, ``+12.35``; else scientific, ``-1.600e-06``). A value
    the column's digits cannot show, or rounding noise next to its scale (``negligible``,
    ``eps`` the run's dtype's; next to ``floor`` when that is larger, as a parameter's
    gradient is next to the largest one's, as ``tfm check`` says) is ``≈0``; an exact zero
    is `` 0`` in the column's digits.

    >>> write = column([0.5, -3e-6, 0.0]); write(0.5), write(-3e-6), write(0.0)
    ('+0.5000', '≈0', ' 0.0000')
    >>> column([1.6e-06, -2e-7])(-2e-7)
    '-2.000e-07'
    """
    values = np.asarray(values, dtype=np.float64).ravel()
    finite = np.abs(values[np.isfinite(values)])
    scale = float(finite.max()) if finite.size else 0.0
    if scale == 0.0:
        return lambda v: fmt(v, DIGITS)
    fixed = FIXED_RANGE[0] <= scale < FIXED_RANGE[1]
    style = "fixed" if fixed else "sci"
    precision = max(0, DIGITS - 1 - math.floor(math.log10(scale))) if fixed else DIGITS - 1

    def write(value: float) -> str:
        v = float(value)
        if not math.isfinite(v) or v == 0:
            return fmt(v, precision)
        text = fmt(v, precision, style)
        if negligible(v, max(scale, floor), eps) or (fixed and not text.strip("+-0.")):
            return ZERO_TO_PRECISION
        return text

    return write


@dataclass
class Paths:
    """What a gradient entry sums: its formula, its terms in groups (one group per way on)."""

    formula: list[str]
    groups: list[tuple[str, list[str], np.ndarray]] = field(default_factory=list)

    def add(self, label: str, labels: list[str], terms) -> None:
        self.groups.append((label, labels, np.asarray(terms, dtype=np.float64).ravel()))

    def total(self) -> float:
        return float(sum(terms.sum() for _, _, terms in self.groups))

    def lines(self, value: float) -> list[str]:
        """The formula, each group's sum, the largest terms, the sum against ``value``; each
        line within 38 columns. The terms and the groups' sums are one column, written at
        its scale; the sum and the backward's number another (a sum of terms that cancel can
        be far smaller than they are)."""
        lines = list(self.formula)
        count = sum(terms.size for _, _, terms in self.groups)
        labels = [f"{group} {label}" if len(self.groups) > 1 else label
                  for group, names, _ in self.groups for label in names]
        terms = np.concatenate([terms for _, _, terms in self.groups])
        order = np.argsort(-np.abs(terms), kind="stable")
        sums = [t.sum() for _, _, t in self.groups] if len(self.groups) > 1 else []
        listed = terms[order[:TOP]] if count > len(self.groups) else terms[:0]
        rest = [terms[order[TOP:]].sum()] if count > TOP else []
        write = column([*sums, *listed, *rest])
        for (label, _, group), total in zip(self.groups, sums):
            size = f" ({group.size})" if group.size > 1 else ""
            lines.append(f"  {label[:14]:<14} {write(total):>10}{size}")
        if listed.size:
            lines.append("  largest terms:" if count > TOP else "  terms:")
            for k in order[:TOP]:
                lines.append(f"    {labels[k][:16]:<16} {write(terms[k]):>10}")
            if rest:
                lines.append(f"    {f'{count - TOP} more':<16} {write(rest[0]):>10}")
        # next to what rounding acts on (the terms' sizes), a sum of terms that cancel is ≈0
        total = column([self.total(), value], floor=float(np.abs(terms).sum()))
        lines.append(f"  sum {total(self.total()).strip()} (backward {total(value).strip()})")
        return lines


def gradient_paths(ex, view) -> list[str] | None:
    """The lines explaining gradient entry ``view`` as its paths' sum, or None when no rule
    covers this tensor in this architecture (or its terms do not add up to the gradient)."""
    value = float(ex.gradients[view.name][view.index])
    try:
        paths = _rule(ex, view.name, view.index)
    except (KeyError, IndexError, ValueError):
        return None
    if paths is None or not paths.groups:
        return None
    size = max(abs(value), sum(np.abs(terms).sum() for _, _, terms in paths.groups))
    if abs(paths.total() - value) > 1e-9 * size + 1e-300:
        return None
    return paths.lines(value)


def _rule(ex, name: str, index) -> Paths | None:
    m = re.match(r"(blocks\.\d+\.)(.*)", name)
    prefix, part = (m[1], m[2]) if m else ("", name)
    if ex.is_param(name):
        if part in LINEAR:
            return _linear_weight(ex, prefix, part, index)
        if part in BIASES:
            return _bias(ex, prefix + BIASES[part], index)
        if name in ("head.W_U", "head.b_U"):
            return (_weight(ex, _final(ex), "logits", "head.W_U", index) if name == "head.W_U"
                    else _bias(ex, "logits", index))
        if part.endswith((".gamma", ".beta")):
            return _norm_param(ex, prefix, part, index)
        if name == "embed.W_E":
            return _embedding(ex, index)
        if name == "embed.W_pos":
            return _embed_sum(ex, name, index)
        return None
    if part in READERS:
        return _readers(ex, prefix, part, index)
    if name == "ln_f.out" or (name == _final(ex) and "ln_f.out" not in ex.values):
        return _readers(ex, "", name, index)
    if part in ("resid1", "in", "out", "resid2", "attn.out", "ffn.out") and m:
        return _residual(ex, prefix, part, index)
    if part == "attn.pattern":
        return _pattern(ex, prefix, index)
    if part == "attn.scores":
        return _scores(ex, prefix, index)
    if part in ("attn.q", "attn.q_rot", "attn.k", "attn.k_rot", "attn.v"):
        return _qkv(ex, prefix, part, index)
    if name in ("logits", "probs"):
        return _logits(ex, name, index)
    if part in ("ffn.pre", "ffn.gate"):
        return _ffn_hidden(ex, prefix, part, index)
    if name in ("embed", "pe", "embed.W_pos"):
        return _embed_sum(ex, name, index)
    return None


# ------------------------------------------------------------------ helpers


def _merged(a: np.ndarray) -> np.ndarray:
    """(B, H, T, d_head) -> (B, T, H d_head): the heads side by side, as the weights see them."""
    return a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1) if a.ndim == 4 else a


def _positions(ex, shape) -> list[str]:
    """'r0 t2:4' for every (row, position), in the order of a (B, T) array's ravel."""
    B, T = shape
    return [f"r{b} t{t}:{ex.run.token_labels(b)[t]}" for b in range(B) for t in range(T)]


def _final(ex) -> str:
    """What the head reads: the final norm's output, or (Post-LN) the last block's."""
    return "ln_f.out" if "ln_f.out" in ex.values else f"blocks.{ex.cfg.layers - 1}.out"


def one(value: float) -> str:
    """One number on its own, to four significant digits (``column`` of one)."""
    return column([value])(value)


def _token(ex, v: int) -> str:
    """Vocabulary entry ``v``: its id, and its text where that is not the id ('464 The'),
    never ``id:text``, which reads as a position's ``pos:token``."""
    text = ex.run.token_text(v)
    return str(v) if text == str(v) else f"{v} {text}"


def _tail(name: str) -> str:
    return name.split(".", 2)[-1] if name.startswith("blocks.") else name


# ------------------------------------------------------------------ parameters


def _linear_weight(ex, prefix, part, index) -> Paths | None:
    inputs, output = LINEAR[part]
    for source in inputs:
        if prefix + source in ex.values:
            paths = _weight(ex, prefix + source, prefix + output, prefix + part, index)
            size = max(abs(float(ex.gradients[prefix + part][index])), 1e-300)
            if abs(paths.total() - ex.gradients[prefix + part][index]) <= 1e-9 * size:
                return paths
    return None


def _weight(ex, source, output, weight, index) -> Paths:
    i, j = index
    x, dy = _merged(ex.values[source]), _merged(ex.gradients[output])
    paths = Paths(["= sum over rows r, positions t of",
                   f"  {_tail(source)}[r, t, {i}]", f"  x d{_tail(output)}[r, t, {j}]"])
    paths.add("", _positions(ex, x.shape[:2]), x[:, :, i] * dy[:, :, j])
    return paths


def _bias(ex, output, index) -> Paths:
    dy = _merged(ex.gradients[output])
    paths = Paths(["= sum over rows r, positions t of", f"  d{_tail(output)}[r, t, {index[0]}]"])
    paths.add("", _positions(ex, dy.shape[:2]), dy[:, :, index[0]])
    return paths


def _norm_input(ex, prefix, norm) -> list[str]:
    """What norm ``norm`` (ln1, ln2, ln_f) may have read, most likely first."""
    if norm == "ln_f":
        return [f"blocks.{ex.cfg.layers - 1}.out"]
    if norm == "ln1":   # Post-LN's norms read the sums
        return [prefix + "in", prefix + "resid1"]
    return [prefix + "resid1", prefix + "in", prefix + "resid2"]


def _xhat(ex, x: np.ndarray) -> np.ndarray:
    ones = np.ones(x.shape[-1])
    if ex.cfg.rms_norm:
        return ops.rms_norm_forward(x, ones, ex.cfg.eps)[0]
    return ops.layer_norm_forward(x, ones, None, ex.cfg.eps)[0]


def _norm_param(ex, prefix, part, index) -> Paths | None:
    norm, kind = part.rsplit(".", 1)
    out = prefix + norm + ".out"
    if out not in ex.gradients:
        return None
    dy, c = ex.gradients[out], index[0]
    labels = _positions(ex, dy.shape[:2])
    if kind == "beta":
        paths = Paths(["= sum over rows r, positions t of", f"  d{norm}.out[r, t, {c}]"])
        paths.add("", labels, dy[:, :, c])
        return paths
    for source in _norm_input(ex, prefix, norm):
        if source in ex.values:
            xhat = _xhat(ex, ex.values[source])
            paths = Paths(["= sum over rows r, positions t of",
                           f"  xhat[r, t, {c}] x d{norm}.out[r, t, {c}]",
                           f"  (xhat: {_tail(source)} normalised)"])
            paths.add("", labels, xhat[:, :, c] * dy[:, :, c])
            if abs(paths.total() - ex.gradients[prefix + part][index]) <= 1e-9 * max(
                    np.abs(xhat[:, :, c] * dy[:, :, c]).sum(), 1e-300):
                return paths
    return None


def _embedding(ex, index) -> Paths:
    v, i = index
    tokens = ex.run.inputs.tokens
    factor = ex.cfg.embed_factor if ex.cfg.embed_scale else 1.0
    lookup = ex.gradients["embed"][:, :, i] * factor
    labels = _positions(ex, tokens.shape)
    used = (tokens == v).ravel()
    paths = Paths([f"= sum over the positions of token {v}", f"  of dembed[r, t, {i}]"
                   + (f" x {factor:.4g}" if factor != 1.0 else "")])
    paths.add("embedding", [label for label, u in zip(labels, used) if u], lookup.ravel()[used])
    if ex.cfg.tied_head:
        x, dz = ex.values[_final(ex)], ex.gradients["logits"]
        paths.formula += ["+ (tied head) sum over r, t of", f"  {_tail(_final(ex))}[r, t, {i}]"
                          f" x dlogits[r, t, {v}]"]
        paths.add("head", labels, x[:, :, i] * dz[:, :, v])
    return paths


# ------------------------------------------------------------------ activations


def _readers(ex, prefix, part, index) -> Paths:
    """An activation read by weights: one term per number each weight makes from it."""
    b, t, i = index
    readers = [(w, LINEAR[w][1]) for w in READERS.get(part, ())] if prefix or part in READERS \
        else []
    if not readers:   # the final norm's output (or the last block's), read by the head
        weight = ex.run.params["head.W_U"] if "head.W_U" in ex.run.params else \
            ex.run.params["embed.W_E"].T
        paths = Paths(["= sum over tokens v of", f"  W_U[{i}, v] x dlogits[{b}, t{t}, v]"])
        paths.add("", [f"v {_token(ex, v)}" for v in range(weight.shape[1])],
                  weight[i] * ex.gradients["logits"][b, t])
        return paths
    paths = Paths(["= sum over the numbers it feeds:", f"  W[{i}, j] x dy[j], for each W",
                   "  that reads it"])
    for weight, output in readers:
        if prefix + weight not in ex.run.params or prefix + output not in ex.gradients:
            continue
        sources = [s for s in LINEAR[weight][0] if prefix + s in ex.values]
        if sources[0] != part:   # W_1 reads ln2.out when there is one
            continue
        W = ex.run.params[prefix + weight]
        dy = _merged(ex.gradients[prefix + output])[b, t]
        paths.add(f"via {weight.split('.')[-1]}", [f"j {j}" for j in range(W.shape[1])],
                  W[i] * dy)
    return paths


def _norm_backward(ex, norm: str, x_row, dy_row) -> np.ndarray:
    gamma = ex.run.params[norm + ".gamma"]
    if ex.cfg.rms_norm:
        _, cache = ops.rms_norm_forward(x_row, gamma, ex.cfg.eps)
        return ops.rms_norm_backward(dy_row, cache)[0]
    _, cache = ops.layer_norm_forward(x_row, gamma, None, ex.cfg.eps)
    return ops.layer_norm_backward(dy_row, cache)[0]


def _residual(ex, prefix, part, index) -> Paths | None:
    """The residual stream: its gradient is the skip's (the next sum's) plus the norm's that
    reads it; a sublayer's output passes the sum's gradient on unchanged."""
    b, t, i = index
    block = int(prefix.split(".")[1])
    single = {"attn.out": "resid1", "ffn.out": "resid2", "resid2": "out"}
    if part in single:
        paths = Paths([f"= d{single[part]}: a sum passes its", "  gradient on unchanged"])
        paths.add("", [f"d{single[part]}"], [ex.gradients[prefix + single[part]][index]])
        return paths
    if part == "out":
        if block + 1 < ex.cfg.layers:
            following = f"blocks.{block + 1}.in"
            paths = Paths([f"= d{following}: the next", "  block's input is this number"])
            paths.add("", [f"d{following}"], [ex.gradients[following][index]])
            return paths
        skip, norm = None, "ln_f"
    else:
        skip, norm = ("resid1", "ln1") if part == "in" else ("resid2", "ln2")
    if ex.cfg.norm != "pre" or ex.cfg.sandwich_norm or ex.cfg.parallel_residual:
        return None
    name = norm if norm == "ln_f" else prefix + norm
    x_row = ex.values[prefix + part][b, t]
    through = _norm_backward(ex, name, x_row, ex.gradients[name + ".out"][b, t])[i]
    paths = Paths([f"= the skip + through {norm}"])
    if skip is not None:
        paths.add("skip", [f"d{skip}"], [ex.gradients[prefix + skip][index]])
    paths.add(f"through {norm}", [f"{norm}'s backward"], [through])
    return paths


def _pattern(ex, prefix, index) -> Paths:
    b, h, q, k = index
    dh, g = ex.cfg.d_head, h // ex.cfg.group
    dctx = ex.gradients[prefix + "attn.context"][b, q, h * dh:(h + 1) * dh]
    v = ex.values[prefix + "attn.v"][b, g, k]
    paths = Paths(["= sum over j of", f"  dcontext[{b}, q{q}, head {h}: j]",
                   f"  x v[{b}, {g}, k{k}, j]"])
    paths.add("", [f"j {j}" for j in range(dh)], dctx * v)
    return paths


def _scores(ex, prefix, index) -> Paths:
    b, h, q, k = index
    p = ex.values[prefix + "attn.pattern"][b, h, q]
    dp = ex.gradients[prefix + "attn.pattern"][b, h, q]
    paths = Paths(["softmax's backward, k = {k}:".format(k=k),
                   "  ds_k = p_k (dp_k - sum_j p_j dp_j)"])
    paths.add("", ["p_k dp_k", "-p_k sum_j p_j dp_j"], [p[k] * dp[k], -p[k] * (p @ dp)])
    return paths


def _qkv(ex, prefix, part, index) -> Paths | None:
    b, h, t, j = index
    cfg, base = ex.cfg, prefix + "attn."
    rope = cfg.pe == "rope"
    if rope and part in ("attn.q", "attn.k"):
        return None   # RoPE's backward sits between: q_rot and k_rot have the sums
    q = ex.values[base + ("q_rot" if rope else "q")]
    k = ex.values[base + ("k_rot" if rope else "k")]
    ds, scale = ex.gradients[base + "scores"], cfg.score_scale
    heads = range(h * cfg.group, (h + 1) * cfg.group)     # the query heads a k or v head serves
    T = q.shape[2]
    if part.startswith("attn.q"):
        g = h // cfg.group
        paths = Paths(["= scale x sum over keys k of", f"  dscores[{b}, {h}, q{t}, k]",
                       f"  x k[{b}, {g}, k, {j}]"])
        paths.add("", [f"k{s}:{ex.run.token_labels(b)[s]}" for s in range(T)],
                  scale * np.nan_to_num(ds[b, h, t]) * k[b, g, :, j])
        return paths
    if part.startswith("attn.k"):
        paths = Paths(["= scale x sum over queries q", "  (and the heads it serves) of",
                       f"  dscores[., q, k{t}] x q[., q, {j}]"])
        for head in heads:
            paths.add(f"head {head}", [f"q{s}" for s in range(T)],
                      scale * np.nan_to_num(ds[b, head, :, t]) * q[b, head, :, j])
        return paths
    dh = cfg.d_head
    p, dctx = ex.values[base + "pattern"], ex.gradients[base + "context"]
    paths = Paths(["= sum over queries q", "  (and the heads it serves) of",
                   f"  pattern[., q, k{t}]", f"  x dcontext[{b}, q, head: {j}]"])
    for head in heads:
        paths.add(f"head {head}", [f"q{s}" for s in range(T)],
                  p[b, head, :, t] * dctx[b, :, head * dh + j])
    return paths


def _logits(ex, name, index) -> Paths:
    b, t, v = index
    inputs = ex.run.inputs
    T = inputs.tokens.shape[1]
    valid = (np.arange(T)[None, :] < inputs.lengths[:, None]) & (inputs.targets != IGNORE)
    target = int(inputs.targets[b, t])
    n = int(valid.sum())
    if not valid[b, t]:
        paths = Paths([f"row {b} position {t} is not scored", "  (padding, or no next token)"])
        paths.add("", ["not scored"], [0.0])
        return paths
    p = float(ex.values["probs"][b, t, v])
    about = f"  target {_token(ex, target)}, N = {n} scored positions"
    if name == "probs":
        paths = Paths(["loss = -mean log p_target, so", "  dp_v = -[v = target] / (N p_v)",
                       about])
        paths.add("", ["-[v = target] / (N p_v)"], [-float(v == target) / (n * p)])
        return paths
    paths = Paths(["cross-entropy's backward:", "  dz_v = (p_v - [v = target]) / N", about])
    paths.add("", ["p_v / N", "-[v = target] / N"], [p / n, -float(v == target) / n])
    return paths


def _ffn_hidden(ex, prefix, part, index) -> Paths:
    """The FFN's hidden layer: the chain rule through the activation, one number at a time."""
    b, t, i = index
    act, dact = ex.cfg.activation, ex.gradients[prefix + "ffn.act"][b, t]
    pre = ex.values[prefix + "ffn.pre"][b, t]
    if not ex.cfg.gated:
        forward, backward = ops.ACTIVATIONS[act]
        slope = backward(np.ones_like(pre), forward(pre)[1])[i]
        paths = Paths([f"= {act}'(pre) x dact:",
                       f"  {act}'({one(pre[i])}) = {one(slope)}", f"  dact = {one(dact[i])}"])
        paths.add("", ["slope x dact"], [slope * dact[i]])
        return paths
    gate = ex.values[prefix + "ffn.gate"][b, t]
    forward, backward = ops.GATES[act]
    dgate, dpre = backward(np.ones_like(pre), forward(gate, pre)[1])
    f = "silu" if act == "swiglu" else "gelu"
    if part == "ffn.pre":
        paths = Paths([f"act = {f}(gate) x pre, so", f"  dpre = {f}(gate) x dact:",
                       f"  {f}({one(gate[i])}) = {one(dpre[i])}", f"  dact = {one(dact[i])}"])
        paths.add("", [f"{f}(gate) x dact"], [dpre[i] * dact[i]])
    else:
        paths = Paths([f"act = {f}(gate) x pre, so", f"  dgate = pre x {f}'(gate) x dact:",
                       f"  pre x {f}'(gate) = {one(dgate[i])}", f"  dact = {one(dact[i])}"])
        paths.add("", [f"pre {f}'(gate) dact"], [dgate[i] * dact[i]])
    return paths


def _embed_sum(ex, name, index) -> Paths:
    """The first block's input is the embedding plus the positions: each gets its gradient;
    a position's vector is shared by the rows, so its gradient sums them."""
    grad_in = ex.gradients["blocks.0.in"]
    if name == "embed":
        paths = Paths(["= dblocks.0.in: the embedding is", "  added into the stream"])
        paths.add("", ["dblocks.0.in"], [grad_in[index]])
        return paths
    t, i = index
    if t >= grad_in.shape[1]:
        paths = Paths([f"position {t} is past this run's", f"  {grad_in.shape[1]} tokens: unused"])
        paths.add("", ["unused"], [0.0])
        return paths
    paths = Paths(["= sum over rows r of", f"  dblocks.0.in[r, {t}, {i}]",
                   "  (every row adds the same vector)"])
    paths.add("", [f"row {b}" for b in range(grad_in.shape[0])], grad_in[:, t, i])
    return paths
