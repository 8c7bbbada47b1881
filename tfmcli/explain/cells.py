"""One cell of a run explained: its formula with the run's numbers, the value the formula gives
(``claimed``) beside the value the run recorded, checked before it is shown.

The formula reads the tensors the pass kept (``fwd.acts``: after any intervention), so a cell
whose inputs were changed is explained from the changed inputs and holds. A cell that differs
from its formula does so because an intervention changed it (or a tensor the formula derives on
the way): the explanation names the intervention and shows both numbers. Any other difference
is a bug in tfm, said so in the explanation and caught by the tests (tests/test_explain.py).

The explorer (``tui``) and ``agreement`` for the per-part views draw these; nothing here renders.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from tfmcli.engine import ops, positional
from tfmcli.render.numbers import FIXED_RANGE, one

HOLDS = 1e-12   # a formula agrees with a float64 record to this much of the tensor's scale
ROUNDING = 8   # and with a float32, float16 or bfloat16 one to this many of its dtype's eps


def holds_to(dtype: str) -> float:
    """How close a formula worked in float64 comes to a run's record in ``dtype``: 1e-12 of
    the tensor's scale in float64; ROUNDING eps of the dtype in the others (its numbers were
    rounded at every step, the formula's not)."""
    from tfmcli.engine import precision

    return max(HOLDS, ROUNDING * precision.of(dtype).eps) if dtype != "float64" else HOLDS


@dataclass(frozen=True)
class Explanation:
    """``where = recorded``, the formula's ``lines``, what it gives (``claimed``; None where no
    rule covers the cell), the tensors it reads or derives (``reads``) and the interventions
    that changed any of them or the cell (``changed``)."""

    where: str
    recorded: float
    claimed: float | None
    lines: tuple[str, ...]
    reads: tuple[str, ...]
    scale: float
    changed: tuple[str, ...] = ()
    tolerance: float = HOLDS   # of the scale (holds_to: wider in a rounded dtype)

    @property
    def holds(self) -> bool:
        """The formula gives the recorded value, to HOLDS of the tensor's scale (or no rule)."""
        if self.claimed is None:
            return True
        if not (np.isfinite(self.claimed) and np.isfinite(self.recorded)):
            return self.claimed == self.recorded
        return abs(self.claimed - self.recorded) <= self.tolerance * max(self.scale,
                                                                         abs(self.recorded))

    @property
    def bug(self) -> bool:
        """Differs, and no intervention says why."""
        return not self.holds and not self.changed

    def text(self) -> list[str]:
        """The lines shown: the value, the formula, and where they differ, why (each of the
        two numbers at its own scale, four significant digits: ``one``)."""
        lines = [f"{self.where} = {0.0 if self.recorded == 0 else self.recorded:.6g}"]
        if self.holds:
            return lines + list(self.lines)
        claimed, recorded = (one(v).strip() for v in (self.claimed, self.recorded))
        if claimed == recorded:   # close: as many digits as tell them apart
            claimed, recorded = f"{self.claimed:+.12g}", f"{self.recorded:+.12g}"
        made = f"the formula gives {claimed}, the run recorded {recorded}"
        if self.changed:
            return lines + [f"changed by {'; '.join(self.changed)}:", f"  {made}",
                            *self.lines]
        return lines + [f"a bug in tfm: {made} (please report it)", *self.lines]


def interventions_on(fwd, names: Iterable[str]) -> tuple[str, ...]:
    """The interventions of the run that changed any of the activations ``names``."""
    plan = fwd.caches.get("plan") if fwd is not None else None
    if not plan:
        return ()
    found = []
    for name in names:
        for intervention, _, _ in plan.steps.get(name, ()):
            found.append(intervention.describe())
    return tuple(dict.fromkeys(found))


def _plus(b: float) -> str:
    """' + 0.5' or ' - 0.5': a term added, its sign once."""
    return f" {'-' if b < 0 else '+'} {_v(abs(b), signed=False)}"


def _v(x: float, signed: bool = True, digits: int = 6) -> str:
    """A number in a formula's line: ``digits`` decimals in the fixed range (``+0.277574``),
    scientific outside it (``-1.60000e-06``, never ``-0.000000``), an exact zero ``0``."""
    x = float(x)
    if x == 0:
        return "0"
    sign = "+" if signed else ""
    if FIXED_RANGE[0] <= abs(x) < FIXED_RANGE[1] or not np.isfinite(x):
        return f"{x:{sign}.{digits}f}"
    return f"{x:{sign}.{digits - 1}e}"


def explain_value(run, fwd, name: str, index: tuple, where: str) -> Explanation:
    """Activation or parameter ``name`` at ``index``, explained from the tensors the pass kept."""
    values = {**fwd.acts, **run.params}
    array = values[name]
    recorded = float(array[index])
    finite = np.abs(array[np.isfinite(array)])
    scale = float(finite.max()) if finite.size else 0.0
    rule = _rule(run, fwd, values, name, index, recorded)
    if rule is None:
        return Explanation(where, recorded, None, (), (), scale)
    claimed, lines, reads, derives = rule
    tolerance = holds_to(run.cfg.dtype)
    changed = interventions_on(fwd, (name, *derives))
    explanation = Explanation(where, recorded, claimed, tuple(lines), tuple(reads), scale,
                              changed, tolerance)
    if explanation.holds:   # holds: an intervention upstream is in the numbers already
        return Explanation(where, recorded, claimed, tuple(lines), tuple(reads), scale,
                           (), tolerance)
    return explanation


def _rule(run, fwd, values, name, index, recorded):
    """(claimed, lines, reads, derives) of the cell, or None where no rule covers it.
    ``derives``: the tensors the formula works out again rather than reads (an intervention
    on one of them explains a difference)."""
    cfg = run.cfg
    if name.endswith("attn.pattern"):
        base = name[:-len("pattern")]
        scores = values[base + "scores"][index[:3]]
        seen = np.isfinite(scores)
        top = scores[seen].max()
        exps = np.exp(scores[seen] - top)
        lines = ["softmax over the keys the query sees:",
                 "  p_j = e^(s_j - m) / sum e^(s - m)",
                 "  s = " + " ".join(f"{_v(s, digits=4)}" for s in scores[seen]),
                 f"  m = max s = {_v(top, digits=4)}, "
                 f"sum = {_v(exps.sum(), signed=False, digits=4)}"]
        if seen[index[3]]:
            claimed = float(np.exp(scores[index[3]] - top) / exps.sum())
            top_k = np.exp(scores[index[3]] - top)
            lines.append(f"  {_v(claimed, signed=False, digits=4)} = "
                         f"{_v(top_k, signed=False, digits=4)} / "
                         f"{_v(exps.sum(), signed=False, digits=4)}")
        else:
            claimed = 0.0
            lines.append("  this key is hidden by the mask: p = 0")
        return claimed, lines + ["Enter: the scores row"], [base + "scores"], []
    if name.endswith("attn.scores"):
        return _score(cfg, values, name, index, recorded)
    if re.fullmatch(r"blocks\.\d+\.resid[12]", name):
        before, source = _summands(cfg, name)
        if before not in values or source not in values:
            return None
        a, b = float(values[before][index]), float(values[source][index])
        return a + b, [f"residual sum: {before.split('.', 2)[-1]} + "
                       f"{source.split('.', 2)[-1]}",
                       f"  {_v(a)}{_plus(b)} = {_v(a + b)}",
                       "Enter: the sublayer's output"], [before, source], []
    if re.fullmatch(r"(blocks\.\d+\.)?(ln1|ln2|ln1_post|ln2_post|ln_f|ln_embed|attn\.q_norm|"
                    r"attn\.k_norm)\.out", name):
        return _norm(cfg, run.params, values, name, index)
    if name == "probs":
        logits = values["logits"][index[:2]]
        exps = np.exp(logits - logits.max())
        claimed = float(exps[index[2]] / exps.sum())
        return claimed, ["p_v = exp(z_v - max) / sum_w exp(z_w - max)",
                         f"  z_v = {_v(logits[index[2]])}, max = {_v(logits.max())}",
                         "Enter: the logits"], ["logits"], []
    return _made(run, values, name, index) or _carried(run, values, name, index)


def attention_input(cfg, prefix: str) -> str:
    """What block ``prefix``'s attention reads: ln1's output, or (Post-LN) the block's input."""
    return prefix + ("in" if cfg.norm == "post" else "ln1.out")


def _carried(run, values, name, index):
    """The cells a block's attention makes a head at a time (q, k, v, their RoPE turn, the
    context), what flows between blocks (a block's input and output), the positions' rows and
    capped logits."""
    cfg, P = run.cfg, run.params
    m = re.fullmatch(r"(blocks\.(\d+)\.)(attn\.(q|k|v|q_rot|k_rot|context)|in|out)", name)
    if m and m[4] in ("q", "k", "v"):   # x . W[:, h d_head + j] + b
        b, h, t, j = index
        x_name = attention_input(cfg, m[1])
        column = h * cfg.d_head + j
        W, bias = P[m[1] + f"attn.W_{m[4].upper()}"], P.get(m[1] + f"attn.b_{m[4].upper()}")
        x = values[x_name][b, t]
        dot = float(x @ W[:, column])
        made = dot + (0.0 if bias is None else float(bias[column]))
        return made, [f"= {x_name.split('.', 2)[-1]}[{b}, t{t}] . W_{m[4].upper()}[:, {column}]"
                      + (" + b" if bias is not None else "") + f"  (head {h}'s column {j})",
                      f"  = {_v(dot)}" + (_plus(float(bias[column])) if bias is not None
                                           else "")], [x_name], []
    if m and m[4] in ("q_rot", "k_rot"):   # x_j cos + rotate_half(x)_j sin
        from tfmcli.engine.blocks import rope_for

        b, h, t, j = index
        which = m[4][0]
        source = m[1] + (f"attn.{which}_norm.out" if cfg.qk_norm else f"attn.{which}")
        x = values[source][b, h, t]
        cos, sin = rope_for(cfg, values[source].shape[2], int(m[2]))
        n = cos.shape[-1]
        if j >= n:
            return float(x[j]), [f"= {source.split('.', 2)[-1]}[..., {j}]: past the rotary "
                                 f"dims ({n}), not turned"], [source], []
        partner = j + n // 2 if j < n // 2 else j - n // 2
        turned = -x[partner] if j < n // 2 else x[partner]
        made = float(x[j] * cos[t, j] + turned * sin[t, j])
        return made, [f"RoPE at position {t}: x_{j} cos + rotate_half(x)_{j} sin",
                      f"  = {_v(x[j])} x {_v(cos[t, j], signed=False)}{_plus(float(turned))} x "
                      f"{_v(sin[t, j])}", f"  (rotate_half(x)_{j} = "
                      f"{'-' if j < n // 2 else ''}x_{partner})"], [source], []
    if m and m[4] == "context":   # sum_k p_k v_k, head h's slice
        b, t, column = index
        h, j = divmod(column, cfg.d_head)
        pattern = values[m[1] + "attn.pattern"][b, h, t]
        v = values[m[1] + "attn.v"][b, h // cfg.group, :, j]
        seen = np.nonzero(pattern)[0]
        made = float(pattern @ v)
        terms = " ".join(f"{_v(pattern[k], signed=False, digits=4)}x{_v(v[k], digits=4)}"
                         for k in seen[:6])
        return made, [f"= sum_k p_k v_k  (head {h}, column {j} of its values)",
                      f"  = {terms}{' ...' if len(seen) > 6 else ''}"],\
            [m[1] + "attn.pattern", m[1] + "attn.v"], []
    if m and m[3] == "in":
        i = int(m[2])
        if i:
            source = f"blocks.{i - 1}.out"
            return float(values[source][index]), [f"= {source}: the previous block's output"
                                                  ], [source], []
        if cfg.embed_norm:
            return float(values["ln_embed.out"][index]), ["= ln_embed.out"], ["ln_embed.out"], []
        e = float(values["embed"][index])
        if "pe" not in values:
            return e, ["= embed (the positions are turned into q and k, or none)"], ["embed"], []
        pe = float(values["pe"][index[1:]])
        return e + pe, ["= embed + pe", f"  = {_v(e)}{_plus(pe)}"], ["embed", "pe"], []
    if m and m[3] == "out":
        source = m[1] + ("ln2.out" if cfg.norm == "post" else "resid2")
        return float(values[source][index]), [f"= {source.split('.', 2)[-1]}: the block's last "
                                              f"sum"], [source], []
    if name == "pe":
        t, j = index
        if cfg.pe == "learned":
            return float(P["embed.W_pos"][t, j]), [f"= W_pos[{t}, {j}] (learned)"], \
                ["embed.W_pos"], []
        angle = float(positional.angles(t, cfg.d_model)[j])
        made = float(np.sin(angle) if j % 2 == 0 else np.cos(angle))
        return made, [f"= {'sin' if j % 2 == 0 else 'cos'}({t} / 10000^({2 * (j // 2)}/"
                      f"{cfg.d_model})) = {'sin' if j % 2 == 0 else 'cos'}"
                      f"({_v(angle, signed=False)})"], [], []
    if name == "logits":   # capped: c tanh(z / c)
        source = "ln_f.out" if "ln_f.out" in values else f"blocks.{cfg.layers - 1}.out"
        x = values[source][index[:2]]
        W_U = P["embed.W_E"].T if cfg.tied_head else P["head.W_U"]
        z = float(x @ W_U[:, index[2]]) + (float(P["head.b_U"][index[2]]) if cfg.head_bias
                                           else 0.0)
        c = cfg.logit_softcap
        made = float(ops.softcap_forward(np.array(z), c))
        return made, [f"= {c:g} tanh(z / {c:g}), z = h . W_U[:, {index[2]}]"
                      + (" + b_U" if cfg.head_bias else ""), f"  z = {_v(z)}"], [source], []
    return None


def score_inputs(cfg, base: str) -> tuple[str, str]:
    """The queries and keys attention ``base`` (``blocks.0.attn.``) scored: turned (RoPE),
    else normed (qk_norm), else as made."""
    return tuple(base + f"{w}_rot" if cfg.pe == "rope" else base + f"{w}_norm.out"
                 if cfg.qk_norm else base + w for w in "qk")


def _score(cfg, values, name, index, recorded):
    base = name[:-len("scores")]
    q_name, k_name = score_inputs(cfg, base)
    if not np.isfinite(recorded):
        return -np.inf, ["hidden by the mask: -inf before the softmax"], [], []
    q = values[q_name][index[0], index[1], index[2]]
    k = values[k_name][index[0], index[1] // cfg.group, index[3]]
    plain = float(q @ k) * cfg.score_scale
    claimed, extra = plain, []
    if cfg.pe == "alibi":
        bias = float(positional.alibi_bias(index[2] + 1, cfg.heads)[index[1], index[2], index[3]])
        claimed += bias
        extra.append(f"  + ALiBi {_v(bias)} = {_v(claimed)}")
    if cfg.attn_softcap is not None:
        c = cfg.attn_softcap
        claimed = float(ops.softcap_forward(np.array(claimed), c))
        extra.append(f"  capped: {c:g} tanh(s / {c:g}) = {_v(claimed)}")
    return claimed, [f"s = (q . k) x {cfg.score_scale:.4g}"
                     + (" (then ALiBi, the cap)" if cfg.pe == "alibi" or cfg.attn_softcap
                        else ""),
                     f"  q . k = {_v(q @ k)}", f"  (q . k) x scale = {_v(plain)}", *extra,
                     "Enter: the query"], [q_name, k_name], []


def _summands(cfg, name: str) -> tuple[str, str]:
    """What a block's residual sum adds: resid1 = in + attention's output; resid2 = resid1
    (Post-LN: ln1's output) + the FFN's output; a sandwich's outputs normed first."""
    p = name.rsplit(".", 1)[0] + "."
    if name.endswith("resid1"):
        return p + "in", p + ("ln1_post.out" if cfg.sandwich_norm else "attn.out")
    return (p + ("ln1.out" if cfg.norm == "post" else "resid1"),
            p + ("ln2_post.out" if cfg.sandwich_norm else "ffn.out"))


def norm_input(cfg, name: str) -> str:
    """The tensor a norm reads: Pre-LN's ln1 the block's input and ln2 resid1 (a parallel
    block's, its input); Post-LN's the sums; a sandwich's the sublayer's output; ln_f the last
    block's output."""
    if name == "ln_f.out":
        return f"blocks.{cfg.layers - 1}.out"
    if name == "ln_embed.out":
        return "embed"
    if name.endswith(("q_norm.out", "k_norm.out")):   # each head's q or k, over its d_head
        return name[:-len("_norm.out")]
    p, part = name.rsplit(".", 2)[0] + ".", name.rsplit(".", 2)[-2]
    if part.endswith("_post"):
        return p + ("attn.out" if part == "ln1_post" else "ffn.out")
    if cfg.norm == "post":
        return p + ("resid1" if part == "ln1" else "resid2")
    return p + ("in" if part == "ln1" or cfg.parallel_residual else "resid1")


def _norm(cfg, params, values, name, index):
    source = norm_input(cfg, name)
    if source not in values:
        return None
    x = values[source][index[:-1]]
    gamma = float(params[name[:-len(".out")] + ".gamma"][index[-1]])
    if cfg.rms_norm:
        rms = float(np.sqrt((x * x).mean() + cfg.eps))
        claimed = float(x[index[-1]]) / rms * gamma
        return claimed, ["RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma",
                         f"  x = {_v(x[index[-1]])}, rms = {_v(rms, signed=False)}, "
                         f"gamma = {_v(gamma)}",
                         f"  y = {_v(claimed)}"], [source], []
    mean, var = x.mean(), x.var()
    beta = params.get(name[:-len(".out")] + ".beta")
    beta = 0.0 if beta is None else float(beta[index[-1]])
    xhat = float((x[index[-1]] - mean) / np.sqrt(var + cfg.eps))
    claimed = gamma * xhat + beta
    return claimed, ["layer norm: y = gamma (x - mean) / sqrt(var + eps) + beta",
                     f"  x = {_v(x[index[-1]])}, mean = {_v(mean)}, var = {_v(var, signed=False)}",
                     f"  xhat = {_v(xhat)}, gamma = {_v(gamma)}, beta = {_v(beta)}",
                     f"  y = {_v(claimed)}"], [source], []


# what a tensor of a Pre-LN block is made from: the one input a formula reads first (and the
# explorer's Enter follows)
SOURCES = {"resid1": "attn.out", "resid2": "ffn.out", "out": "resid2",
           "attn.out": "attn.context", "ffn.out": "ffn.act", "ffn.act": "ffn.pre",
           "ffn.pre": "ln2.out", "ffn.gate": "ln2.out", "attn.q": "ln1.out", "attn.k": "ln1.out",
           "attn.v": "ln1.out", "attn.q_rot": "attn.q", "attn.k_rot": "attn.k", "ln1.out": "in",
           "ln2.out": "resid1"}
WEIGHTS = {"ffn.pre": "ffn.W_1", "ffn.gate": "ffn.W_gate", "ffn.out": "ffn.W_2",
           "attn.out": "attn.W_O"}


def _made(run, values, name, index):
    """The cells whose formula is one product or one function: a projection's column
    (x . W[:, j] + b_j), the FFN's activation, the embedding's row, a logit."""
    cfg, P = run.cfg, run.params
    m = re.match(r"(blocks\.\d+\.)(ffn\.pre|ffn\.gate|ffn\.out|attn\.out)$", name)
    if m:
        weight = WEIGHTS[m[2]]
        source = m[1] + SOURCES[m[2]]
        if m[2] in ("ffn.pre", "ffn.gate") and (cfg.norm == "post" or source not in values):
            source = m[1] + "ln1.out"   # Post-LN's FFN reads ln1's output, a shared norm's too
        if source not in values:
            return None
        x = values[source][index[:2]]
        W, b = P[m[1] + weight], P.get(m[1] + weight.replace("W_", "b_"))
        dot = float(x @ W[:, index[2]])
        made = dot + (0.0 if b is None else float(b[index[2]]))
        return made, [f"= {source.split('.', 2)[-1]}[{index[0]}, t{index[1]}] . "
                      f"{weight.split('.')[-1]}[:, {index[2]}]" + (" + b" if b is not None
                                                                   else ""),
                      f"  = {_v(dot)}" + (_plus(float(b[index[2]])) if b is not None else "")
                      ], [source], []
    if name.endswith("ffn.act") and not cfg.gated:
        pre = values[name[:-len("act")] + "pre"][index]
        forward = ops.ACTIVATIONS[cfg.activation][0]
        made = float(forward(np.array([pre]))[0][0])
        return made, [f"= {cfg.activation}(pre) = {cfg.activation}({_v(pre)})"], [
            name[:-len("act")] + "pre"], []
    if name.endswith("ffn.act"):   # gated: f(gate) x pre
        pre = values[name[:-len("act")] + "pre"][index]
        gate = values[name[:-len("act")] + "gate"][index]
        forward = ops.GATES[cfg.activation][0]
        made = float(forward(np.array([gate]), np.array([pre]))[0][0])
        f = "silu" if cfg.activation == "swiglu" else "gelu"
        return made, [f"= {f}(gate) x pre", f"  = {f}({_v(gate)}) x {_v(pre)}"], [
            name[:-len("act")] + "pre", name[:-len("act")] + "gate"], []
    if name == "embed":
        token = int(run.inputs.tokens[index[0], index[1]])
        made = float(P["embed.W_E"][token, index[2]]) * (cfg.embed_factor if cfg.embed_scale
                                                         else 1.0)
        return made, [f"= W_E[{token}, {index[2]}]" + (f" x {cfg.embed_factor:.4g}" if
                                                       cfg.embed_scale else ""),
                      f"  token {token}:{run.token_text(token)}", "Enter: that row of W_E"
                      ], ["embed.W_E"], []
    if name == "logits" and cfg.logit_softcap is None:
        source = "ln_f.out" if "ln_f.out" in values else f"blocks.{cfg.layers - 1}.out"
        x = values[source][index[:2]]
        W_U = P["embed.W_E"].T if cfg.tied_head else P["head.W_U"]
        b = float(P["head.b_U"][index[2]]) if cfg.head_bias else 0.0
        made = float(x @ W_U[:, index[2]]) + b
        return made, [f"= h . W_U[:, {index[2]}]" + (" + b_U" if cfg.head_bias else ""),
                      f"  = {_v(made - b)}" + (_plus(b) if cfg.head_bias else "")], [source], []
    return None


@dataclass(frozen=True)
class Agreement:
    """A per-part view's own working (an attention row, a block's sums) beside the run's
    record: ``off`` the largest difference, ``scale`` the record's largest magnitude, and the
    interventions on what the working derives again (``changed``)."""

    what: str
    off: float
    scale: float
    changed: tuple[str, ...]
    tolerance: float = HOLDS   # of the scale: central differences hold to about 1e-6

    @property
    def holds(self) -> bool:
        return self.off <= self.tolerance * max(self.scale, np.finfo(np.float64).tiny)

    def sentence(self, differs: str = "differs from this", by: str = "by") -> str:
        """'the model's own ... differs from this by 1.1e-16', and where it does by more than
        rounding, why: the intervention that changed it, or a bug."""
        said = f"{self.what} {differs}".strip() + f" {by} {self.off:.1e}"
        if self.holds:
            return said
        if self.changed:
            return (f"{said}: {'; '.join(self.changed)} changed the run, and the steps above "
                    f"are the formula on the tensors it kept")
        return f"{said}: more than rounding, a bug in tfm (please report it)"


def agreement(fwd, what: str, mine, recorded, derives: Iterable[str],
              tolerance: float = HOLDS) -> Agreement:
    """``mine`` (a view's working) against ``recorded`` (the run's own), naming the
    interventions on ``derives``: the tensors the working computes again. A run in a rounded
    dtype holds to that dtype's rounding (``holds_to``) at least."""
    mine, recorded = np.asarray(mine, dtype=np.float64), np.asarray(recorded, dtype=np.float64)
    off = float(np.abs(mine - recorded).max()) if recorded.size else 0.0
    scale = float(np.abs(recorded).max()) if recorded.size else 0.0
    cfg = fwd.caches.get("cfg") if fwd is not None else None
    if cfg is not None:
        tolerance = max(tolerance, holds_to(cfg.dtype))
    return Agreement(what, off, scale, interventions_on(fwd, derives), tolerance)
