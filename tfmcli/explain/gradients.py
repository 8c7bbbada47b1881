"""A gradient entry as the sum of its paths, each term one way its number reaches the loss,
checked against the backward's number before it is shown (an ``cells.Explanation``).

A parameter's gradient sums one term per position it was used at (``dW[i, j] = sum over b, t
of x[b, t, i] dy[b, t, j]``). An activation's sums one group of terms per thing that reads it:
a weight (``W[i, j] dy[j]`` for each number it makes), a sum it is added into (that sum's
gradient), a norm (the norm's backward), the head (``W_U[i, v] dz[v]``). ``readers`` says, for
each architecture, what reads what: it is the forward's graph, written once.

The terms read the tensors the pass kept (after any intervention) and the gradients the
backward kept. An intervention on a tensor changes what reaches the tensors that made it (a set
or ablated entry passes no gradient on, a scaled one passes it scaled): where the sum differs
from the backward's number because of one, the explanation names it; any other difference is a
bug, and ``tests/test_explain.py`` walks every gradient entry to catch it. A tensor no rule
covers says so, never a wrong sum.

Numbers are written as the explorer writes every column (``render.numbers.column``): at the
column's scale with four significant digits, so a gradient of 1.6e-06 is ``-1.600e-06``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tfmcli.engine import ops
from tfmcli.engine.inputs import IGNORE
from tfmcli.explain.cells import Explanation, holds_to, interventions_on, norm_input, score_inputs
from tfmcli.render.numbers import column, one

TOP = 4   # terms listed one by one; the rest are summed in one line
NUMBERS = 32   # where a column of numbers ends (WIDTH where the words need it)
WIDTH = 36   # a line's widest: the explorer's 40-column pane less its border, padding, scrollbar

# weight -> the activation it makes, within one block
MAKES = {"attn.W_Q": "attn.q", "attn.W_K": "attn.k", "attn.W_V": "attn.v",
         "attn.W_O": "attn.out", "ffn.W_gate": "ffn.gate", "ffn.W_1": "ffn.pre",
         "ffn.W_2": "ffn.out"}
BIASES = {"attn.b_Q": "attn.q", "attn.b_K": "attn.k", "attn.b_V": "attn.v",
          "attn.b_O": "attn.out", "ffn.b_gate": "ffn.gate", "ffn.b_1": "ffn.pre",
          "ffn.b_2": "ffn.out"}
NORMS = r"(ln1|ln2|ln1_post|ln2_post|attn\.q_norm|attn\.k_norm)"


@dataclass
class Paths:
    """What a gradient entry sums: its formula, the numbers it names (``given``: label and
    number, written in the column of the terms), its terms in groups (one group per way on),
    and ``via``: the activations whose kept gradients the terms read (an intervention on one
    changes what reaches this entry)."""

    formula: list[str]
    groups: list[tuple[str, list[str], np.ndarray]] = field(default_factory=list)
    via: list[str] = field(default_factory=list)
    given: list[tuple[str, str]] = field(default_factory=list)

    def add(self, label: str, labels: list[str], terms, via: str | None = None) -> None:
        self.groups.append((label, labels, np.asarray(terms, dtype=np.float64).ravel()))
        if via is not None:
            self.via.append(via)

    def total(self) -> float:
        return float(sum(terms.sum() for _, _, terms in self.groups))

    def size(self) -> float:
        """What rounding acts on: the sum of the terms' magnitudes."""
        return float(sum(np.abs(terms).sum() for _, _, terms in self.groups))

    def lines(self, value: float) -> list[str]:
        """The formula, each group's sum, the largest terms, then the sum and the backward's
        number, each line within WIDTH: every number right-aligned in one column under the
        others. The terms and the groups' sums are written at their scale; the sum and the
        backward's number at theirs (a sum of terms that cancel can be far smaller)."""
        count = sum(terms.size for _, _, terms in self.groups)
        labels = [label if len(self.groups) == 1 else group if len(names) == 1 else
                  f"{group} {label}" for group, names, _ in self.groups for label in names]
        terms = np.concatenate([terms for _, _, terms in self.groups])
        order = np.argsort(-np.abs(terms), kind="stable")
        sums = [t.sum() for _, _, t in self.groups] if len(self.groups) > 1 else []
        listed = terms[order[:TOP]] if count > len(self.groups) else terms[:0]
        rest = [terms[order[TOP:]].sum()] if count > TOP else []
        write = column([*sums, *listed, *rest])
        rows: list[tuple[str, str | None]] = []   # (the line's words, its number)
        for (label, _, group), total in zip(self.groups, sums):
            rows.append((f"  {label}" + (f" ({group.size})" if group.size > 1 else ""),
                         write(total)))
        if listed.size:
            rows.append(("  largest terms:" if count > TOP else "  terms:", None))
            rows += [(f"    {labels[k]}", write(terms[k])) for k in order[:TOP]]
            if rest:
                rows.append((f"    {count - TOP} more", write(rest[0])))
        # next to what rounding acts on (the terms' sizes), a sum of terms that cancel is ≈0
        # (each at its own scale where they differ: an intervention stopped or scaled a path)
        total = column([self.total(), value], floor=self.size())
        both = [total(self.total()).strip(), total(value).strip()]
        if both[0] != both[1]:
            both = [column([v], floor=self.size())(v).strip() for v in (self.total(), value)]
        rows += [("  sum", both[0]), ("  backward", both[1])]
        return list(self.formula) + aligned([*self.given, *rows])


def aligned(rows: list[tuple[str, str | None]]) -> list[str]:
    """Lines of words and a number, the numbers right-aligned in one column ending at
    column NUMBERS (further, to WIDTH, for long words), so that they stay in place from one
    cell to the next; words too long even then cut with an ellipsis."""
    digits = max(len(number) for _, number in rows if number is not None)
    longest = max(len(text) for text, number in rows if number is not None)
    words = min(WIDTH - 1 - digits, max(longest, NUMBERS - 1 - digits))
    lines = []
    for text, number in rows:
        if number is None:
            lines.append(text)
            continue
        text = text if len(text) <= words else text[:words - 1] + "…"
        lines.append(f"{text:<{words}} {number:>{digits}}")
    return lines


class Record:
    """What the rules read: the run, its kept activations and parameters (``values``), the
    backward's gradients of both (``gradients``)."""

    def __init__(self, run, fwd, grads):
        self.run, self.fwd, self.cfg = run, fwd, run.cfg
        self.values = {**fwd.acts, **run.params}
        self.gradients = {**grads.acts, **grads}

    def is_param(self, name: str) -> bool:
        return name in self.run.params


def explain_gradient(run, fwd, grads, name: str, index: tuple, where: str) -> Explanation:
    """The gradient of ``name`` at ``index`` as the sum of its paths, checked against the
    backward's number (``claimed`` None where no rule covers this tensor here)."""
    record = Record(run, fwd, grads)
    array = record.gradients[name]
    recorded = float(array[index]) + 0.0   # -0.0 (softmax's backward of a hidden key) is 0
    finite = np.abs(array[np.isfinite(array)])
    scale = float(finite.max()) if finite.size else 0.0
    paths = rule(record, name, index)
    if paths is None or not paths.groups:
        return Explanation(where, recorded, None, ("d loss / d this entry: the sum",
                                                   "  over every path from it to the loss",
                                                   "  (no breakdown of this tensor here)"),
                           (), scale)
    explanation = Explanation(where, recorded, paths.total(), tuple(paths.lines(recorded)),
                              tuple(paths.via), max(scale, paths.size()),
                              interventions_on(fwd, (name, *paths.via)),
                              holds_to(run.cfg.dtype))
    if explanation.holds:   # an intervention upstream is in the numbers already
        return Explanation(where, recorded, explanation.claimed, explanation.lines,
                           explanation.reads, explanation.scale, (), explanation.tolerance)
    return explanation


def rule(ex: Record, name: str, index) -> Paths | None:
    """The paths of gradient entry ``name[index]``, or None where no rule covers the tensor."""
    m = re.fullmatch(r"(blocks\.\d+\.)(.*)", name)
    prefix, part = (m[1], m[2]) if m else ("", name)
    if ex.is_param(name):
        return _parameter(ex, prefix, part, name, index)
    if name in ("logits", "probs"):
        return _logits(ex, name, index)
    if name in ("pe", "embed"):
        return _embedding_sum(ex, name, index)
    if part == "attn.pattern":
        return _pattern(ex, prefix, index)
    if part == "attn.scores":
        return _scores(ex, prefix, index)
    if part in ("ffn.pre", "ffn.gate"):
        return _ffn_hidden(ex, prefix, part, index)
    if part in ("attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.q_norm.out",
                "attn.k_norm.out"):
        return _head_part(ex, prefix, part, index)
    ways = readers(ex.cfg, name)
    if not ways:
        return None
    paths = Paths(["= the sum over what reads it:"] if len(ways) > 1 else [])
    for kind, target in ways:
        _way(ex, paths, kind, target, index, "  " if len(ways) > 1 else "= ")
    return paths


def readers(cfg, name: str) -> list[tuple[str, str]]:
    """What reads activation ``name`` (of a block's stream, a norm's output, a sublayer's), as
    (kind, target): ``sum`` (added into activation target), ``norm`` (normed by norm target),
    ``linear`` (read by weight target), ``head``. The forward's graph, for every kind of block
    (``engine.blocks``)."""
    if name == "embed":
        return [("norm", "ln_embed")] if cfg.embed_norm else [("sum", "blocks.0.in")]
    if name == "ln_embed.out":
        return [("sum", "blocks.0.in")]
    if name == "ln_f.out":
        return [("head", "")]
    m = re.fullmatch(r"blocks\.(\d+)\.(.*)", name)
    if not m:
        return []
    i, part, p = int(m[1]), m[2], f"blocks.{m[1]}."
    post, parallel, sandwich = cfg.norm == "post", cfg.parallel_residual, cfg.sandwich_norm
    qkv = [("linear", p + f"attn.W_{w}") for w in "QKV"]
    ffn_in = [("linear", p + "ffn.W_gate")] * cfg.gated + [("linear", p + "ffn.W_1")]
    if part == "out":
        if i + 1 < cfg.layers:
            return [("sum", f"blocks.{i + 1}.in")]
        return [("head", "")] if post else [("norm", "ln_f")]
    if part == "in":
        if post:
            return [("sum", p + "resid1"), *qkv]
        two = parallel and not cfg.shared_norm
        return [("sum", p + "resid1"), ("norm", p + "ln1")] + [("norm", p + "ln2")] * two
    if part == "resid1":
        if post:
            return [("norm", p + "ln1")]
        return [("sum", p + "resid2")] + [("norm", p + "ln2")] * (not parallel)
    if part == "resid2":
        return [("norm", p + "ln2")] if post else [("sum", p + "out")]
    if part in ("attn.out", "ffn.out"):
        norm, into = ("ln1_post", "resid1") if part == "attn.out" else ("ln2_post", "resid2")
        return [("norm", p + norm)] if sandwich else [("sum", p + into)]
    if part in ("ln1_post.out", "ln2_post.out"):
        return [("sum", p + ("resid1" if part == "ln1_post.out" else "resid2"))]
    if part == "ln1.out":
        if post:
            return [("sum", p + "resid2"), *ffn_in]
        return qkv + ffn_in * (parallel and cfg.shared_norm)
    if part == "ln2.out":
        return [("sum", p + "out")] if post else ffn_in
    if part == "attn.context":
        return [("linear", p + "attn.W_O")]
    if part == "ffn.act":
        return [("linear", p + "ffn.W_2")]
    return []


def _said(lead: str, *parts: str) -> list[str]:
    """``parts`` on one line after ``lead`` ("= " or "  ") when they fit in WIDTH, else one a
    line, the lines after the first indented two more."""
    line = lead + " ".join(parts)
    if len(line) <= WIDTH:
        return [line]
    under = " " * (len(lead) if not lead.strip() else 0) + "  "
    return [lead + parts[0], *(under + part for part in parts[1:])]


def _way(ex: Record, paths: Paths, kind: str, target: str, index, lead: str = "  ") -> None:
    """Add the group of terms one reader contributes to the gradient at ``index``, its
    formula's lines after ``lead`` ("= " when it is the only reader)."""
    b, t, i = index
    if kind == "sum":
        paths.formula += _said(lead, f"d{_tail(target)}: added into it")
        paths.add(f"into {_tail(target)}", [f"d{_tail(target)}"],
                  [ex.gradients[target][index]], via=target)
    elif kind == "norm":
        x = _norm_source(ex, target)[b, t]
        through = _norm_backward(ex, target, x, ex.gradients[target + ".out"][b, t])[i]
        paths.formula += _said(lead, f"{_tail(target)}'s backward of", f"d{_tail(target)}.out")
        paths.add(f"via {_tail(target)}", [f"{_tail(target)}'s backward"], [through],
                  via=target + ".out")
    elif kind == "linear":
        prefix, weight = target.rsplit(".", 2)[0] + ".", target.split(".", 2)[-1]
        W, output = ex.run.params[target], prefix + MAKES[weight]
        dy = _merged(ex.gradients[output])[b, t]
        short = weight.split(".")[-1]
        paths.formula += _said(lead, f"sum_j {short}[{i}, j]", f"x d{_tail(output)}[j]")
        paths.add(f"via {short}", [f"j {j}" for j in range(W.shape[1])], W[i] * dy,
                  via=output)
    else:   # the head: the logits' every entry
        W_U = ex.run.params["head.W_U"] if "head.W_U" in ex.run.params else \
            ex.run.params["embed.W_E"].T
        under = "  " if lead == "= " else "    "
        paths.formula += _said(lead, f"sum_v W_U[{i}, v]", "x dz[v]") + (
            [f"{under}(dz: dlogits through the cap)"] if ex.cfg.logit_softcap is not None else [])
        paths.add("via the head", [f"v {_token(ex, v)}" for v in range(W_U.shape[1])],
                  W_U[i] * _dz(ex)[b, t], via="logits")


# ------------------------------------------------------------------ helpers


def _merged(a: np.ndarray) -> np.ndarray:
    """(B, H, T, d_head) -> (B, T, H d_head): the heads side by side, as the weights see them."""
    return a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1) if a.ndim == 4 else a


def _positions(ex, shape) -> list[str]:
    """'r0 t2:4' for every (row, position), 'r0 h1 t2:4' with heads, in ravel order."""
    if len(shape) == 3:
        B, H, T = shape
        return [f"r{b} h{h} t{t}:{ex.run.token_labels(b)[t]}"
                for b in range(B) for h in range(H) for t in range(T)]
    B, T = shape
    return [f"r{b} t{t}:{ex.run.token_labels(b)[t]}" for b in range(B) for t in range(T)]


def _final(ex) -> str:
    """What the head reads: the final norm's output, or (Post-LN) the last block's."""
    return "ln_f.out" if "ln_f.out" in ex.values else f"blocks.{ex.cfg.layers - 1}.out"


def _dz(ex) -> np.ndarray:
    """The gradient at the head's product: dlogits, times the cap's slope when capped."""
    dz = ex.gradients["logits"]
    if ex.cfg.logit_softcap is None:
        return dz
    return dz * ops.softcap_slope(ex.values["logits"], ex.cfg.logit_softcap)


def _token(ex, v: int) -> str:
    """Vocabulary entry ``v``: its id, and its text where that is not the id ('464 The'),
    never ``id:text``, which reads as a position's ``pos:token``."""
    text = ex.run.token_text(v)
    return str(v) if text == str(v) else f"{v} {text}"


def _tail(name: str) -> str:
    return name.split(".", 2)[-1] if name.startswith("blocks.") else name


def _norm_source(ex, norm: str) -> np.ndarray:
    """What norm ``norm`` read (ln_embed: the embedding plus the positions' rows)."""
    if norm == "ln_embed":
        x = ex.values["embed"]
        return x + ex.values["pe"] if "pe" in ex.values else x
    return ex.values[norm_input(ex.cfg, norm + ".out")]


def _norm_backward(ex, norm: str, x_row, dy_row) -> np.ndarray:
    gamma = ex.run.params[norm + ".gamma"]
    if ex.cfg.rms_norm:
        _, cache = ops.rms_norm_forward(x_row, gamma, ex.cfg.eps)
        return ops.rms_norm_backward(dy_row, cache)[0]
    _, cache = ops.layer_norm_forward(x_row, gamma, None, ex.cfg.eps)
    return ops.layer_norm_backward(dy_row, cache)[0]


def _xhat(ex, x: np.ndarray) -> np.ndarray:
    ones = np.ones(x.shape[-1])
    if ex.cfg.rms_norm:
        return ops.rms_norm_forward(x, ones, ex.cfg.eps)[0]
    return ops.layer_norm_forward(x, ones, None, ex.cfg.eps)[0]


# ------------------------------------------------------------------ parameters


def _parameter(ex, prefix, part, name, index) -> Paths | None:
    if part in MAKES:
        return _weight(ex, _weight_input(ex.cfg, prefix, part), prefix + MAKES[part], index)
    if part in BIASES:
        return _bias(ex, prefix + BIASES[part], index)
    if name == "head.W_U":
        return _weight(ex, _final(ex), "logits", index)
    if name == "head.b_U":
        return _bias(ex, "logits", index)
    m = re.fullmatch(r"(ln_f|ln_embed|" + NORMS + r")\.(gamma|beta)", part)
    if m:
        return _norm_param(ex, prefix + m[1], m[3], index)
    if name == "embed.W_E":
        return _embedding(ex, index)
    if name == "embed.W_pos":
        return _embedding_sum(ex, name, index)
    return None


def _weight_input(cfg, prefix: str, part: str) -> str:
    """What weight ``part`` of block ``prefix`` reads."""
    from tfmcli.explain.cells import attention_input

    if part in ("attn.W_Q", "attn.W_K", "attn.W_V"):
        return attention_input(cfg, prefix)
    if part == "attn.W_O":
        return prefix + "attn.context"
    if part == "ffn.W_2":
        return prefix + "ffn.act"
    shared = cfg.norm == "post" or (cfg.parallel_residual and cfg.shared_norm)
    return prefix + ("ln1.out" if shared else "ln2.out")


def _weight(ex, source, output, index) -> Paths:
    i, j = index
    x, dy = _merged(ex.values[source]), _merged(ex.gradients[output])
    if output == "logits":
        dy = _dz(ex)
    paths = Paths(["= sum over rows r, positions t of",
                   f"  {_tail(source)}[r, t, {i}]", f"  x d{_tail(output)}[r, t, {j}]"]
                  + (["  (dlogits through the cap)"] if output == "logits" and
                     ex.cfg.logit_softcap is not None else []))
    paths.add("", _positions(ex, x.shape[:2]), x[:, :, i] * dy[:, :, j], via=output)
    return paths


def _bias(ex, output, index) -> Paths:
    dy = _dz(ex) if output == "logits" else _merged(ex.gradients[output])
    paths = Paths(["= sum over rows r, positions t of", f"  d{_tail(output)}[r, t, {index[0]}]"])
    paths.add("", _positions(ex, dy.shape[:2]), dy[:, :, index[0]], via=output)
    return paths


def _norm_param(ex, norm: str, kind: str, index) -> Paths | None:
    """gamma[c] = sum of xhat[..., c] dout[..., c] over every row it normed; beta[c] = sum of
    dout[..., c]. A head's norm (qk_norm) normed every (row, head, position)."""
    out = norm + ".out"
    if out not in ex.gradients:
        return None
    dy, c = ex.gradients[out], index[0]
    labels = _positions(ex, dy.shape[:-1])
    short = _tail(norm).removeprefix("attn.")
    over = (["= sum over rows r, heads h and", "  positions t of"] if dy.ndim == 4 else
            ["= sum over rows r, positions t of"])
    at = f"[r, h, t, {c}]" if dy.ndim == 4 else f"[r, t, {c}]"
    if kind == "beta":
        paths = Paths([*over, f"  d{short}.out{at}"])
        paths.add("", labels, dy[..., c], via=out)
        return paths
    xhat = _xhat(ex, _norm_source(ex, norm))
    paths = Paths([*over, f"  xhat{at}", f"  x d{short}.out{at}",
                   f"  (xhat: {short}'s input, normed)"])
    paths.add("", labels, xhat[..., c] * dy[..., c], via=out)
    return paths


def _embedding(ex, index) -> Paths:
    v, i = index
    tokens = ex.run.inputs.tokens
    factor = ex.cfg.embed_factor if ex.cfg.embed_scale else 1.0
    lookup = ex.gradients["embed"][:, :, i] * factor
    labels = _positions(ex, tokens.shape)
    used = (tokens == v).ravel()
    paths = Paths([f"= sum over positions t of token {v}",
                   f"  of dembed[r, t, {i}]" + (f" x {factor:.4g}" if factor != 1.0 else "")])
    paths.add("embedding", [label for label, u in zip(labels, used) if u],
              lookup.ravel()[used], via="embed")
    if ex.cfg.tied_head:
        x = ex.values[_final(ex)]
        paths.formula += ["+ (tied head) sum over r, t of", f"  {_tail(_final(ex))}[r, t, {i}]",
                          f"  x dz[r, t, {v}]"] + (["  (dz: dlogits through the cap)"]
                                                   if ex.cfg.logit_softcap is not None else [])
        paths.add("head", labels, x[:, :, i] * _dz(ex)[:, :, v], via="logits")
    return paths


def _embedding_sum(ex, name, index) -> Paths:
    """The first block's input is the embedding plus the positions (normed first, with
    ``embed_norm``): the embedding's gradient is the input's; a position's vector is added to
    every row, so its gradient sums the rows."""
    first = "blocks.0.in"
    if name == "embed":
        if ex.cfg.embed_norm:
            paths = Paths(["= ln_embed's backward of", "  dln_embed.out"])
            _way(ex, paths, "norm", "ln_embed", index)
            return paths
        paths = Paths([f"= d{first}: the embedding is", "  added into the stream"])
        paths.add("", [f"d{first}"], [ex.gradients[first][index]], via=first)
        return paths
    t, i = index
    # what the positions' vector was added to: the first block's input, or the norm before it
    into = "embed" if ex.cfg.embed_norm else first
    grad_in = ex.gradients[into]
    if t >= grad_in.shape[1]:
        paths = Paths([f"position {t} is past this run's", f"  {grad_in.shape[1]} tokens: unused"])
        paths.add("", ["unused"], [0.0])
        return paths
    paths = Paths(["= sum over rows r of", f"  d{into}[r, {t}, {i}]",
                   "  (every row adds the same vector)"])
    paths.add("", [f"row {b}" for b in range(grad_in.shape[0])], grad_in[:, t, i], via=into)
    if name == "embed.W_pos":
        paths.via.append("pe")
    return paths


# ------------------------------------------------------------------ attention


def _pattern(ex, prefix, index) -> Paths:
    b, h, q, k = index
    dh, g = ex.cfg.d_head, h // ex.cfg.group
    dctx = ex.gradients[prefix + "attn.context"][b, q, h * dh:(h + 1) * dh]
    v = ex.values[prefix + "attn.v"][b, g, k]
    paths = Paths(["= sum over j of", f"  dcontext[{b}, q{q}, head {h}: j]",
                   f"  x v[{b}, {g}, k{k}, j]"])
    paths.add("", [f"j {j}" for j in range(dh)], dctx * v, via=prefix + "attn.context")
    return paths


def _scores(ex, prefix, index) -> Paths:
    b, h, q, k = index
    p = ex.values[prefix + "attn.pattern"][b, h, q]
    dp = ex.gradients[prefix + "attn.pattern"][b, h, q]
    paths = Paths([f"softmax's backward, k = {k}:", "  ds_k = p_k (dp_k - sum_j p_j dp_j)"])
    paths.add("", ["p_k dp_k", "-p_k sum_j p_j dp_j"], [p[k] * dp[k], -p[k] * (p @ dp)],
              via=prefix + "attn.pattern")
    return paths


def _dscores(ex, prefix) -> np.ndarray:
    """The gradient at q . k x scale: dscores, through the cap's slope when capped; 0 where
    the mask hid the key."""
    base = prefix + "attn."
    ds = np.nan_to_num(ex.gradients[base + "scores"], posinf=0.0, neginf=0.0)
    c = ex.cfg.attn_softcap
    if c is None:
        return ds
    s = ex.values[base + "scores"]
    slope = np.where(np.isfinite(s), 1.0 - (np.where(np.isfinite(s), s, 0.0) / c) ** 2, 0.0)
    return ds * slope


def _head_part(ex, prefix, part, index) -> Paths | None:
    """A head's queries, keys or values, at each stage: read by the scores (or the context),
    by RoPE's turn, or by the head's norm."""
    cfg, base = ex.cfg, prefix + "attn."
    q_read, k_read = score_inputs(cfg, base)
    which = part[len("attn."):][0]   # q, k or v
    if which != "v" and prefix + part not in (q_read, k_read):
        b, h, t, j = index
        if cfg.qk_norm and part in ("attn.q", "attn.k"):
            norm = base + f"{which}_norm"
            x = ex.values[base + which][b, h, t]
            through = _norm_backward(ex, norm, x, ex.gradients[norm + ".out"][b, h, t])[j]
            paths = Paths([f"= {which}_norm's backward of", f"  d{which}_norm.out"])
            paths.add("", [f"{which}_norm's backward"], [through], via=norm + ".out")
            return paths
        return _unturned(ex, prefix, which, index)
    return _read_by_attention(ex, prefix, which, index)


def _unturned(ex, prefix, which, index) -> Paths:
    """Before RoPE's turn: the turn's transpose of d{which}_rot (a turn back by the same
    angle): dx_j = dy_j cos_j + dy_(j+n/2) sin_j (first half), dy_j cos_j - dy_(j-n/2) sin_j
    (second half); past the rotary dimensions, dx_j = dy_j."""
    from tfmcli.engine.blocks import rope_for

    b, h, t, j = index
    rot = prefix + f"attn.{which}_rot"
    dy = ex.gradients[rot][b, h, t]
    cos, sin = rope_for(ex.cfg, ex.gradients[rot].shape[2], int(prefix.split(".")[1]))
    n = cos.shape[-1]
    if j >= n:
        paths = Paths([f"= d{which}_rot[..., {j}]: past the", f"  rotary dims ({n}), not turned"])
        paths.add("", [f"d{which}_rot"], [dy[j]], via=rot)
        return paths
    partner, sign = (j + n // 2, 1.0) if j < n // 2 else (j - n // 2, -1.0)
    plus = "+" if sign > 0 else "-"
    paths = Paths([f"RoPE's turn back at position {t}:",
                   f"  d{which}_rot_{j} cos {plus} d{which}_rot_{partner} sin"])
    paths.add("", [f"d{which}_rot_{j} cos", f"{plus}d{which}_rot_{partner} sin"],
              [dy[j] * cos[t, j], sign * dy[partner] * sin[t, j]], via=rot)
    return paths


def _read_by_attention(ex, prefix, which, index) -> Paths:
    """The queries and keys the scores read (q . k), the values the context reads (p v)."""
    b, h, t, j = index
    cfg, base = ex.cfg, prefix + "attn."
    q_name, k_name = score_inputs(cfg, base)
    heads = range(h * cfg.group, (h + 1) * cfg.group)     # the query heads a k or v head serves
    T = ex.values[q_name].shape[2]
    tokens = ex.run.token_labels(b)
    scale = f"{cfg.score_scale:.4g} x "
    # a key or value head serves `group` query heads: the sum runs over them too (h)
    over = (["= {}sum over queries q of"] if cfg.group == 1 else
            [f"= {{}}sum over the {cfg.group} heads h", "  it serves and queries q of"])
    hq = str(h) if cfg.group == 1 else "h"
    if which == "q":
        g = h // cfg.group
        ds = _dscores(ex, prefix)
        k = ex.values[k_name]
        paths = Paths([f"= {scale}sum over keys k of", f"  dscores[{b}, {h}, q{t}, k]",
                       f"  x {_head_tail(k_name)}[{b}, {g}, k, {j}]"] + _capped(cfg))
        paths.add("", [f"k{s}:{tokens[s]}" for s in range(T)],
                  cfg.score_scale * ds[b, h, t] * k[b, g, :, j], via=base + "scores")
        return paths
    if which == "k":
        ds = _dscores(ex, prefix)
        q = ex.values[q_name]
        paths = Paths([over[0].format(scale), *over[1:], f"  dscores[{b}, {hq}, q, k{t}]",
                       f"  x {_head_tail(q_name)}[{b}, {hq}, q, {j}]"] + _capped(cfg))
        for head in heads:
            paths.add(f"head {head}", [f"q{s}:{tokens[s]}" for s in range(T)],
                      cfg.score_scale * ds[b, head, :, t] * q[b, head, :, j],
                      via=base + "scores")
        return paths
    dh = cfg.d_head
    p, dctx = ex.values[base + "pattern"], ex.gradients[base + "context"]
    paths = Paths([over[0].format(""), *over[1:], f"  pattern[{b}, {hq}, q, k{t}]",
                   f"  x dcontext[{b}, q, head {hq}: {j}]"])
    for head in heads:
        paths.add(f"head {head}", [f"q{s}:{tokens[s]}" for s in range(T)],
                  p[b, head, :, t] * dctx[b, :, head * dh + j], via=base + "context")
    return paths


def _head_tail(name: str) -> str:
    """blocks.0.attn.k_rot -> k_rot: the queries or keys as the scores read them."""
    return name.rsplit("attn.", 1)[-1]


def _capped(cfg) -> list[str]:
    return ["  (dscores through the cap)"] if cfg.attn_softcap is not None else []


# ------------------------------------------------------------------ the rest


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
    about = [f"  target {_token(ex, target)}", f"  N = {n} scored positions"]
    if name == "probs":
        paths = Paths(["loss = -mean log p_target, so", "  dp_v = -[v = target] / (N p_v)",
                       *about])
        paths.add("", ["-[v = target] / (N p_v)"], [-float(v == target) / (n * p)])
        return paths
    paths = Paths(["cross-entropy's backward:", "  dz_v = (p_v - [v = target]) / N", *about])
    paths.add("", ["p_v / N", "-[v = target] / N"], [p / n, -float(v == target) / n])
    return paths


def _ffn_hidden(ex, prefix, part, index) -> Paths:
    """The FFN's hidden layer: the chain rule through the activation, one number at a time."""
    b, t, i = index
    act, dact = ex.cfg.activation, ex.gradients[prefix + "ffn.act"][b, t]
    pre = ex.values[prefix + "ffn.pre"][b, t]
    via = prefix + "ffn.act"
    if not ex.cfg.gated:
        forward, backward = ops.ACTIVATIONS[act]
        slope = backward(np.ones_like(pre), forward(pre)[1])[i]
        paths = Paths([f"= {act}'(pre) x dact:"], given=[
            ("  pre", one(pre[i])), (f"  {act}'(pre)", one(slope)), ("  dact", one(dact[i]))])
        paths.add("", ["slope x dact"], [slope * dact[i]], via=via)
        return paths
    gate = ex.values[prefix + "ffn.gate"][b, t]
    forward, backward = ops.GATES[act]
    dgate, dpre = backward(np.ones_like(pre), forward(gate, pre)[1])
    f = "silu" if act == "swiglu" else "gelu"
    if part == "ffn.pre":
        paths = Paths([f"act = {f}(gate) x pre, so", f"  dpre = {f}(gate) x dact:"], given=[
            ("  gate", one(gate[i])), (f"  {f}(gate)", one(dpre[i])), ("  dact", one(dact[i]))])
        paths.add("", [f"{f}(gate) x dact"], [dpre[i] * dact[i]], via=via)
    else:
        paths = Paths([f"act = {f}(gate) x pre, so", f"  dgate = pre x {f}'(gate) x dact:"],
                      given=[("  pre", one(pre[i])), ("  gate", one(gate[i])),
                             (f"  pre x {f}'(gate)", one(dgate[i])), ("  dact", one(dact[i]))])
        paths.add("", [f"pre {f}'(gate) dact"], [dgate[i] * dact[i]], via=via)
    return paths
