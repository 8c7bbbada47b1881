"""One block at one position: the residual stream, forward and backward (``tfm block``).

Seed 003 writes the Pre-LN block as ``y = x + ATTN(LN1(x))``, ``z = y + FFN(LN2(y))``, and its
backward with the residual split out: the gradient at y is the gradient at z carried straight
through, plus what comes back through the FFN and LN2; the gradient at x is the gradient at y,
plus what comes back through attention and LN1. Post-LN puts each layer norm after its sum
(``y = LN1(x + ATTN(x))``, ``z = LN2(y + FFN(y))``), so nothing reaches x untouched. A parallel
block (GPT-NeoX's) has both sublayers read x (``z = x + ATTN(LN1(x)) + FFN(LN2(x))``), so the
gradient at x gathers dz and both paths, and the gradient at y is dz alone. With one shared
norm (Phi-2's, ``z = x + ATTN(LN1(x)) + FFN(LN1(x))``) both paths meet at LN1's output first.

This lays out each sum at one position, and each path of the backward from pieces the other
views explain: the FFN's input gradient ``dpre W_1^T`` (with SwiGLU ``+ dgate W_gate^T``;
``tfm ffn``), attention's, which sums
what reaches this position as a query, as a key and as a value (``dq W_Q^T + dk W_K^T + dv
W_V^T``; ``tfm attn --backward``), and each layer norm's backward (``tfm ln``). The sums are
checked against the backward pass, and dx against central differences of the block itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import central_differences
from tfmcli.engine import ops
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, Gradients, block_forward, check_within
from tfmcli.explain import layernorm


class Row(NamedTuple):
    name: str
    formula: str
    value: np.ndarray    # (d,) float64
    model: str | None    # the run's activation (forward) or gradient (backward) it must equal


class BlockExplained(NamedTuple):
    forward: list[Row]     # x, the sublayers' outputs and each sum, in order
    backward: list[Row]    # dz back to dx, each path and each sum
    checked: np.ndarray    # the entries of dx checked by central differences
    numeric_dx: np.ndarray  # d sum(dz * block(x)) / d x[row, t, checked], the whole row's dz


def explain(params: dict, fwd: Forward, grads: Gradients, cfg: Config, block: int, row: int,
            t: int, entries: int = 32, step: float = 1e-6) -> BlockExplained:
    """Block ``block`` at batch row ``row``, position ``t``, in float64. Central differences
    run the block again on the row, twice per entry of x checked: every entry when d is no more
    than ``entries``, else those with the largest gradient. A block, row or position the run
    does not have is a ``ValueError``."""
    B, T = fwd.inputs.tokens.shape
    check_within("explain", block=(block, cfg.layers), row=(row, B), position=(t, T))
    p = f"blocks.{block}."

    def act(name):
        return fwd.acts[p + name][row, t].astype(np.float64)

    def grad(name):
        return grads.acts[p + name][row, t].astype(np.float64)

    def ln(name):
        return layernorm.explain(params, fwd, grads.acts[p + name + ".out"], cfg, p + name, row,
                                 t)

    def merged(name):   # (d,): this position's gradient of q, k or v, its heads side by side
        return ops.merge_heads(grads.acts[p + "attn." + name][row:row + 1])[0, t].astype(
            np.float64)

    def weight(name):
        return params[p + name].astype(np.float64)

    ln1, ln2 = ln("ln1"), None if cfg.shared_norm else ln("ln2")
    x, attn, ffn = act("in"), act("attn.out"), act("ffn.out")
    through_ffn = grad("ffn.pre") @ weight("ffn.W_1").T
    ffn_formula = "dpre W_1^T: the FFN's input gradient"
    if cfg.gated:   # x feeds the gate too
        through_ffn = through_ffn + grad("ffn.gate") @ weight("ffn.W_gate").T
        ffn_formula = "dpre W_1^T + dgate W_gate^T: the FFN's input gradient"
    via = {name: merged(name.lower()) @ weight(f"attn.W_{name}").T for name in "QKV"}
    through_attn = via["Q"] + via["K"] + via["V"]
    dz = grad("out")
    above = (f"from block {block + 1}" if block + 1 < cfg.layers else
             "from ln_f" if cfg.norm == "pre" else "from the head")
    attention_rows = [
        Row("via q", "dq W_Q^T: as a query", via["Q"], None),
        Row("via k", "dk W_K^T: as a key, from every query that sees it", via["K"], None),
        Row("via v", "dv W_V^T: as a value, from every query that sees it", via["V"], None)]
    if cfg.sandwich_norm:   # each sublayer's output normalised before its sum
        forward, backward = _sandwich_rows(x, attn, ffn, ln("ln1_post"), ln("ln2_post"), ln1,
                                           ln2, dz, above, ffn_formula, through_ffn,
                                           attention_rows, through_attn)
    elif cfg.shared_norm:
        forward, backward = _shared_rows(x, attn, ffn, ln1, dz, above, ffn_formula,
                                         through_ffn, attention_rows, through_attn)
    elif cfg.parallel_residual:
        forward, backward = _parallel_rows(x, attn, ffn, ln1, ln2, dz, above, ffn_formula,
                                           through_ffn, attention_rows, through_attn)
    elif cfg.norm == "pre":
        y = x + attn
        dy = dz + ln2.dx
        forward = [
            Row("x", "the block's input", x, None),
            Row("attn", "MHA(LN1(x)), attention's output", attn, None),
            Row("y", "x + attn", y, "resid1"),
            Row("ffn", "FFN(LN2(y)), the feed-forward's output", ffn, None),
            Row("z", "y + ffn, the block's output", y + ffn, "out")]
        backward = [
            Row("dz", f"{above}: the gradient at the block's output", dz, None),
            Row("dffn in", ffn_formula, through_ffn, "ln2.out"),
            Row("ffn path", "LN2's backward of dffn in", ln2.dx, None),
            Row("dy", "dz + ffn path (dz carried straight through)", dy,
                "resid1"),
            *attention_rows,
            Row("dattn in", "via q + via k + via v", through_attn, "ln1.out"),
            Row("attn path", "LN1's backward of dattn in", ln1.dx, None),
            Row("dx", "dy + attn path", dy + ln1.dx, "in")]
    else:
        forward = [
            Row("x", "the block's input", x, None),
            Row("attn", "MHA(x), attention's output", attn, None),
            Row("r1", "x + attn", x + attn, "resid1"),
            Row("y", "LN1(r1)", ln1.y, "ln1.out"),
            Row("ffn", "FFN(y), the feed-forward's output", ffn, None),
            Row("r2", "y + ffn", ln1.y + ffn, "resid2"),
            Row("z", "LN2(r2), the block's output", ln2.y, "out")]
        dy = ln2.dx + through_ffn
        backward = [
            Row("dz", f"{above}: the gradient at the block's output", dz, None),
            Row("dr2", "LN2's backward of dz", ln2.dx, "resid2"),
            Row("ffn path", ffn_formula, through_ffn, None),
            Row("dy", "dr2 + ffn path (dr2 carried straight through)", dy,
                "ln1.out"),
            Row("dr1", "LN1's backward of dy", ln1.dx, "resid1"),
            *attention_rows,
            Row("attn path", "via q + via k + via v", through_attn, None),
            Row("dx", "dr1 + attn path", ln1.dx + through_attn, "in")]

    # sum(dz * block(x)) over the row's every position: its gradient in x[row, t] is dx
    mine = {name: value.astype(np.float64) for name, value in params.items()
            if name.startswith(p)}
    cfg64 = cfg.replace(dtype="float64")
    xs = fwd.acts[p + "in"][row:row + 1].astype(np.float64)                   # (1, T, d)
    dzs = grads.acts[p + "out"][row].astype(np.float64)                       # (T, d)
    lengths = fwd.inputs.lengths[row:row + 1]
    dx = backward[-1].value
    checked = np.sort(np.argsort(-np.abs(dx), kind="stable")[:entries])

    def contracted(values):
        nudged = xs.copy()
        nudged[0, t, checked] = values
        return float(np.sum(dzs * block_forward(mine, nudged, cfg64, block, lengths)[0]))

    numeric = central_differences(contracted, xs[0, t, checked].copy(), step)
    return BlockExplained(forward, backward, checked, numeric)


def _parallel_rows(x, attn, ffn, ln1, ln2, dz, above, ffn_formula, through_ffn,
                   attention_rows, through_attn) -> tuple[list[Row], list[Row]]:
    """The forward and backward rows of a parallel block: ``y = x + MHA(LN1(x))``,
    ``z = y + FFN(LN2(x))``. Nothing reads y but the sum, so dy is dz; x feeds both sublayers
    and the stream, so dx is dz plus both paths."""
    y = x + attn
    forward = [
        Row("x", "the block's input", x, None),
        Row("attn", "MHA(LN1(x)), attention's output", attn, None),
        Row("y", "x + attn", y, "resid1"),
        Row("ffn", "FFN(LN2(x)), the feed-forward's output, beside attention", ffn, None),
        Row("z", "y + ffn, the block's output", y + ffn, "out")]
    backward = [
        Row("dz", f"{above}: the gradient at the block's output", dz, None),
        Row("dffn in", ffn_formula, through_ffn, "ln2.out"),
        Row("ffn path", "LN2's backward of dffn in", ln2.dx, None),
        Row("dy", "dz carried straight through (the FFN reads x, not y)", dz, "resid1"),
        *attention_rows,
        Row("dattn in", "via q + via k + via v", through_attn, "ln1.out"),
        Row("attn path", "LN1's backward of dattn in", ln1.dx, None),
        Row("dx", "dz + attn path + ffn path", dz + ln1.dx + ln2.dx, "in")]
    return forward, backward


def _shared_rows(x, attn, ffn, ln1, dz, above, ffn_formula, through_ffn, attention_rows,
                 through_attn) -> tuple[list[Row], list[Row]]:
    """The rows of a parallel block with one norm: ``y = x + MHA(LN1(x))``,
    ``z = y + FFN(LN1(x))``. Both sublayers read LN1's output, so its gradient is the sum of
    their input gradients, and LN1's backward of that is x's one path besides dz."""
    y = x + attn
    dh = through_attn + through_ffn
    forward = [
        Row("x", "the block's input", x, None),
        Row("attn", "MHA(LN1(x)), attention's output", attn, None),
        Row("y", "x + attn", y, "resid1"),
        Row("ffn", "FFN(LN1(x)), the feed-forward's output, from the same norm", ffn, None),
        Row("z", "y + ffn, the block's output", y + ffn, "out")]
    backward = [
        Row("dz", f"{above}: the gradient at the block's output", dz, None),
        Row("dffn in", ffn_formula, through_ffn, None),
        Row("dy", "dz carried straight through (the FFN reads LN1(x), not y)", dz, "resid1"),
        *attention_rows,
        Row("dattn in", "via q + via k + via v", through_attn, None),
        Row("dh", "dattn in + dffn in: both read h = LN1(x)", dh, "ln1.out"),
        Row("norm path", "LN1's backward of dh", ln1.dx, None),
        Row("dx", "dz + norm path", dz + ln1.dx, "in")]
    return forward, backward


def _sandwich_rows(x, attn, ffn, post1, post2, ln1, ln2, dz, above, ffn_formula, through_ffn,
                   attention_rows, through_attn):
    """The rows of a sandwich block, ``y = x + LN1_post(attn)``, ``z = y + LN2_post(ffn)``:
    each residual sum takes the normalised output, and each path of the backward goes back
    through its sublayer's output norm first."""
    y = x + post1.y
    dy = dz + ln2.dx
    forward = [
        Row("x", "the block's input", x, None),
        Row("attn", "MHA(LN1(x)), attention's output", attn, None),
        Row("attn normed", "LN1_post(attn)", post1.y, "ln1_post.out"),
        Row("y", "x + attn normed", y, "resid1"),
        Row("ffn", "FFN(LN2(y)), the feed-forward's output", ffn, None),
        Row("ffn normed", "LN2_post(ffn)", post2.y, "ln2_post.out"),
        Row("z", "y + ffn normed, the block's output", y + post2.y, "out")]
    backward = [
        Row("dz", f"{above}: the gradient at the block's output", dz, None),
        Row("dffn", "LN2_post's backward of dz", post2.dx, "ffn.out"),
        Row("dffn in", ffn_formula, through_ffn, "ln2.out"),
        Row("ffn path", "LN2's backward of dffn in", ln2.dx, None),
        Row("dy", "dz + ffn path (dz carried straight through)", dy, "resid1"),
        Row("dattn", "LN1_post's backward of dy", post1.dx, "attn.out"),
        *attention_rows,
        Row("dattn in", "via q + via k + via v", through_attn, "ln1.out"),
        Row("attn path", "LN1's backward of dattn in", ln1.dx, None),
        Row("dx", "dy + attn path", dy + ln1.dx, "in")]
    return forward, backward
