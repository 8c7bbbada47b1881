"""tfm attn: one attention head step by step, from the model or seed 002's worked example."""

import math
from typing import Annotated, Optional

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Precision,
    Row,
    check_indices,
    describe,
    emit,
    execute,
    position_labels,
    width,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    check_range,
    with_options,
)
from tfmcli.cli.streaming import block_tensors


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def attn(
    example: Annotated[Optional[str], typer.Option(
        "--example", help="'illustrated': seed 002's integer example.")] = None,
    block: Annotated[int, typer.Option(
        "--block", callback=bounded(0), help="Block of the head.")] = 0,
    head: Annotated[int, typer.Option("--head", callback=bounded(0), help="Head to follow.")] = 0,
    row: Row = 0,
    query: Annotated[Optional[int], typer.Option(
        "--query", "-q", callback=bounded(0), help="This query's row, number by number.")] = None,
    backward: Annotated[bool, typer.Option(
        "--backward", help="The backward too, down to dQ, dK, dV.")] = False,
    precision: Precision = 4,
    opts: Options = None,
):
    """One attention head step by step: X, Q, K, V, scores, scaled, masked, softmax, context.

    With --backward, on from the context's gradient to dQ, dK and dV.

    Example: tfm attn --example illustrated
    """
    from tfmcli.explain.cells import agreement
    from tfmcli.explain.steps import (
        illustrated_steps,
        model_head_backward_steps,
        model_head_steps,
        sharing,
    )
    from tfmcli.io import jsonable, run_arrays

    if example not in (None, "illustrated"):
        raise typer.BadParameter(f"{example!r} is not a known example; the one there is: "
                                 f"illustrated", param_hint="'--example'")
    if example == "illustrated":
        refuse_model_options(opts)
        unscaled, scaled = illustrated_steps(1.0), illustrated_steps(1 / math.sqrt(3))
        parts = [Text("Seed 002's worked example: X (3x4) and integer W_Q, W_K, W_V (4x3), no "
                      "mask, no biases. The note's code takes softmax(Q K^T) WITHOUT the "
                      "1/sqrt(d_k) scale: that result is on the left; the scaled one "
                      "(d_k = 3, as the formula says) on the right.", style="bold")]
        parts += render_steps(unscaled[:5], precision)
        # then the softmax and the context (no mask: the model's scaled and masked steps are
        # the right-hand side here), numbered on from the scores
        for k, (a, b) in enumerate(zip(unscaled[7:], scaled[7:]), start=6):
            parts.append(render.side_by_side(
                render.tensor_table(a.value, title=f"{k}. {a.name}, unscaled (the note's code)",
                                    precision=precision),
                render.tensor_table(b.value, title=f"{k}. {b.name}, scaled by 1/sqrt(3)",
                                    precision=precision)))
        payload = {"example": "illustrated",
                   "unscaled": {s.name: jsonable(s.value) for s in unscaled},
                   "scaled": {s.name: jsonable(s.value) for s in scaled}}
        arrays = {f"unscaled/{s.name}": s.value for s in unscaled}
        arrays.update({f"scaled/{s.name}": s.value for s in scaled})
        emit(opts, parts, payload, arrays)
        return
    def validate(cfg):
        check_indices(cfg, row, head, block)
        if query is not None:
            check_range(query, cfg.seq_len, "--query", "positions")

    run, fwd, grads = execute(opts, with_grads=backward, validate=validate,
                              keep=lambda run: block_tensors(run.cfg, block),
                              held=lambda run: block_tensors(run.cfg, block))
    cfg, params, inputs = run.cfg, run.params, run.inputs
    if query is not None:
        explain_one_query(opts, run, fwd, grads, block, head, row, query, precision)
        return
    steps = model_head_steps(params, fwd, cfg, block, head, row)
    queries, keys = position_labels(run, row, "q"), position_labels(run, row, "k")
    parts = [render.config_panel(describe(cfg, run, row),
                                 title=f"tfm attn: block {block}, head {head}, batch row {row}")]
    parts += render_steps(steps, precision, queries, keys)
    payload = {"block": block, "head": head, "row": row,
               "steps": [{"name": s.name, "formula": s.formula, "value": jsonable(s.value)}
                         for s in steps]}
    if backward:
        p = f"blocks.{block}.attn."
        back = model_head_backward_steps(fwd, grads.acts[p + "context"], cfg, block, head, row)
        own = {"dsoftmax": "pattern", "dV": "v", "dscaled scores": "scores", "dQ": "q",
               "dK": "k", "dQ_rot": "q_rot", "dK_rot": "k_rot", "dQ_norm": "q_norm.out",
               "dK_norm": "k_norm.out"}   # the backward pass's own
        if cfg.attn_softcap is not None:   # the softmax took the capped scores: theirs is kept
            own["dcapped scores"] = own.pop("dscaled scores")
        values = {s.name: s.value for s in back}
        shared = head // cfg.group
        if cfg.group > 1:   # a shared key head's gradient: the sum of its query heads' shares
            group = [{s.name: s.value for s in model_head_backward_steps(
                         fwd, grads.acts[p + "context"], cfg, block, h, row)}
                     for h in range(shared * cfg.group, (shared + 1) * cfg.group)]
            for name in SHARED_GRADS & set(values):
                values[name] = sum(steps_of[name] for steps_of in group)
        checked = [s.name for s in back if s.name in own]

        off = agreement(fwd, f"{', '.join(checked[:-1])} and {checked[-1]}", np.concatenate(
            [values[name].ravel() for name in checked]), np.concatenate(
            [grads.acts[p + own[name]][row, shared if name in SHARED_GRADS else head].ravel()
             for name in checked]), [f"blocks.{block}.{part}" for part in HEAD_PARTS])
        parts.append(Text("backward, from the gradient of this head's context", style="bold"))
        parts += render_steps(back, precision, queries, keys, start=len(steps) + 1)
        if cfg.group > 1:
            own_share = [s.name for s in back if s.name in SHARED_GRADS]
            parts.append(Text(f"{', '.join(own_share[:-1])} and {own_share[-1]} are head "
                              f"{head}'s share: key head {shared}'s gradients are the sums over "
                              f"query heads {sharing(cfg, head)}, and those sums are checked",
                              style="dim"))
        parts.append(Text(off.sentence("differ from the backward pass's own gradients",
                                       by="by at most"), style="dim"))
        payload["backward_steps"] = [{"name": s.name, "formula": s.formula,
                                      "value": jsonable(s.value)} for s in back]
        payload["backward_model_diff"] = off.off
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd, grads))


def refuse_model_options(opts):
    """Seed 002's example is fixed numbers: a model, tokens or a head typed with it would be
    silently ignored, so each is an error."""
    shown = ("precision", "json", "svg", "save", "example")
    for param in opts.ctx.command.params:
        if param.name not in shown and opts.explicit(param.name):
            raise typer.BadParameter(
                f"seed 002's worked example is fixed numbers, so it takes no {param.opts[0]}; "
                f"with it: --precision, --json, --svg, --save", param_hint="'--example'")


VECTORS = {"X", "Q", "K", "V", "Q_norm", "K_norm", "Q_rot", "K_rot", "context", "dcontext",
           "dV", "dQ", "dK", "dQ_rot", "dK_rot", "dQ_norm", "dK_norm"}   # rows of features
KEY_ROWS = {"K", "V", "K_norm", "K_rot", "dK", "dV", "dK_rot", "dK_norm"}   # one row per key
# what a head's working derives again: an intervention on one explains a difference
HEAD_PARTS = ("attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.q_norm.out",
              "attn.k_norm.out", "attn.scores", "attn.pattern", "attn.context")
SHARED_GRADS = {"dK", "dV", "dK_rot", "dK_norm"}   # grouped: a key head's, summed over its
#                                                   query heads


def render_steps(steps, precision, queries=None, keys=None, start=1):
    """Each step's formula over its table, numbered from ``start``; with labels, rows are the
    queries (tokens), or the keys for K, V and their gradients, and the columns of a (T, T)
    step the keys."""
    parts = []
    for i, step in enumerate(steps, start):
        parts.append(Text.assemble((f"{i}. {step.name} {step.value.shape}", "bold"),
                                   f"   {step.formula}"))
        labels = {}
        if queries is not None:
            labels["row_labels"] = keys if step.name in KEY_ROWS else queries
            if step.name not in VECTORS:
                labels["col_labels"] = keys
        parts.append(render.tensor_table(step.value, precision=precision, width=width(),
                                         mask=step.mask, **labels))
    return parts


def explain_one_query(opts, run, fwd, grads, block, head, row, t, precision):
    """tfm attn --query t: every number of one attention row, labelled by its tokens; with
    grads (--backward), its backward too."""
    from tfmcli.engine.positional import slope_name
    from tfmcli.explain.cells import agreement
    from tfmcli.explain.steps import (
        explain_query,
        explain_query_backward,
        head_slope,
        scale_name,
        scored,
        sharing,
    )
    from tfmcli.io import run_arrays

    cfg = run.cfg
    rope = cfg.pe == "rope"   # q and k are the turned ones
    q_name = "attn." + scored(cfg, "q")   # what the scores multiply
    normed = (", normalised" + (" and" if rope else f" ({q_name})")) if cfg.qk_norm else ""
    x = explain_query(fwd, cfg, block, head, row, t)
    labels = position_labels(run, row)
    keys = position_labels(run, row, "k")
    seen = [s for s in range(len(keys)) if x.visible[s]]
    dims = [str(i) for i in range(cfg.d_head)]
    shown = [k for s, k in enumerate(keys) if x.visible[s]]
    w = width()

    def table(array, title, rows, cols):
        return render.tensor_table(array, title=title, row_labels=rows, col_labels=cols,
                                   precision=precision, width=w)

    cap = cfg.attn_softcap
    alibi = x.bias is not None   # ALiBi's -m (t - j) added to the scaled scores

    # a hidden key's numbers: its row of K is never shown, so neither are they
    def cell(values, s):
        return float(values[s]) if x.visible[s] else "·"

    score_rows = [[keys[s], cell(x.scores, s), cell(x.scaled, s),
                   *([cell(x.bias, s), cell(x.biased, s)] if alibi else []),
                   *([cell(x.capped, s)] if cap is not None else []),
                   "visible" if x.visible[s] else "hidden", cell(x.weights, s)]
                  for s in range(len(keys))]
    capping = "" if cap is None else f", capped ({cap:g} tanh(scaled / {cap:g}))"
    if alibi:
        capping = (f", ALiBi's -m (t - j) added (m = {slope_name(head_slope(cfg, head))})"
                   + capping.replace("scaled /", "biased /"))
    parts = [
        render.config_panel(describe(cfg, run, row), title=f"tfm attn: block {block}, head "
                                                          f"{head}, query {labels[t]}"),
        Text(f"1. the query q = row {t} of Q (token {labels[t]}){normed}" + (
             f", turned by RoPE at position {t} (attn.q_rot)" if rope else ""), style="bold"),
        table(x.q[None, :], None, [position_labels(run, row, "q")[t]], dims),
        Text("2. each visible key k = a row of K" + (
             f" of key head {head // cfg.group}, shared by query heads {sharing(cfg, head)}"
             if cfg.group > 1 else "") + (", normalised" if cfg.qk_norm else "") + (
             ", each turned at its own position (attn.k_rot)" if rope else
             " (attn.k_norm.out)" if cfg.qk_norm else ""), style="bold"),
        table(x.k[seen], None, shown, dims),
        Text("3. q_i x k_i, and their sum: the score q . k", style="bold"),
        table(np.column_stack([x.products[seen], x.scores[seen]]), None, shown,
              dims + ["Σ score"]),
        Text(f"4. scaled by {scale_name(cfg)} = {x.scale:.6g}{capping}, masked, softmax over the "
             f"visible keys", style="bold"),
        render.record_table(["key", "score", "scaled", *(["ALiBi", "biased"] if alibi else []),
                             *(["capped"] if cap is not None else []),
                             "mask", "softmax"], score_rows, precision=precision),
        Text("5. softmax weight x v, and their sum: the context row", style="bold"),
        table(np.vstack([x.weighted[seen], x.context]), None,
              [f"w·v {k}" for k in shown] + ["Σ context"], dims),
    ]
    p = f"blocks.{block}.attn."
    model = fwd.acts[p + "context"][row, t, head * cfg.d_head:(head + 1) * cfg.d_head]
    parts.append(Text(agreement(fwd, "the model's own context row (attn.context)", x.context,
                                model, [p + "scores", p + "pattern", p + "context"]
                                ).sentence("differs from this sum"), style="dim"))
    payload = {"block": block, "head": head, "row": row, "query": t, "token": labels[t],
               "q": x.q.tolist(), "scale": x.scale, "context": x.context.tolist(),
               "keys": [{"position": s, "token": keys[s], "k": x.k[s].tolist(),
                         "products": x.products[s].tolist(), "score": float(x.scores[s]),
                         "scaled": float(x.scaled[s]),
                         **({"alibi": float(x.bias[s])} if alibi else {}),
                         **({"capped": float(x.capped[s])} if cap is not None else {}),
                         "visible": bool(x.visible[s]),
                         "weight": float(x.weights[s]), "weighted_v": x.weighted[s].tolist()}
                        for s in range(len(keys))]}
    if grads is not None:
        p = f"blocks.{block}.attn."
        xb = explain_query_backward(fwd, grads.acts[p + "context"], cfg, block, head, row, t)
        model = {name: grads.acts[p + act][row, head, t]
                 for name, act in (("dq", scored(cfg, "q")), ("dscaled", "scores"))}
        softmax_in = xb.dscaled if xb.dcapped is None else xb.dcapped   # the softmax's input's
        dname = "dscaled" if xb.dcapped is None else "dcapped"
        parts_of = [f"blocks.{block}.{part}" for part in HEAD_PARTS]   # (changed: said so)
        offs = {"dscaled": agreement(fwd, f"the backward pass's own {dname} row (attn.scores)",
                                     softmax_in, model["dscaled"], parts_of),
                "dq": agreement(fwd, "dq", xb.dq, model["dq"], parts_of),
                "dq_numeric": agreement(fwd, "", xb.numeric_dq, xb.dq, parts_of, 1e-6)}
        before = "q_norm.out" if cfg.qk_norm else "q"   # what RoPE turned
        if rope:
            offs["dq_turned_back"] = agreement(fwd, "it", xb.dq_turned_back,
                                               grads.acts[p + before][row, head, t], parts_of)
        parts += query_backward_parts(xb, x, keys, seen, shown, dims, offs, table,
                                      precision, row, t, q_name, "attn." + before,
                                      scale_name(cfg))
        payload["backward"] = {
            "dcontext": xb.dcontext.tolist(), "weighted_sum": xb.weighted_sum,
            "dq": xb.dq.tolist(), "dq_model_diff": offs["dq"].off,
            "dq_numeric_diff": offs["dq_numeric"].off, "dscaled_model_diff": offs["dscaled"].off,
            **({"dq_turned_back": xb.dq_turned_back.tolist(),
                "dq_turned_back_model_diff": offs["dq_turned_back"].off} if rope else {}),
            "keys": [{"position": s, "dweight": float(xb.dweights[s]),
                      "dscaled": float(xb.dscaled[s]), "dscore": float(xb.dscores[s]),
                      **({"dcapped": float(xb.dcapped[s]), "slope": float(xb.slope[s])}
                         if cap is not None else {}),
                      "dk_share": xb.dk_share[s].tolist(), "dv_share": xb.dv_share[s].tolist()}
                     for s in range(len(keys))]}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))


def query_backward_parts(xb, x, keys, seen, shown, dims, offs, table, precision, row, t,
                         q_name="attn.q", before="attn.q", scale_by="1/sqrt(d_head)"):
    """Steps 6-9 of --query --backward: dcontext to dweights, the softmax's backward, dq, and
    this query's share of each key's dk and dv. ``q_name``: the activation the scores
    multiply; ``before``: what RoPE turned into it; ``scale_by``: the scale's name
    (``steps.scale_name``)."""
    def num(value):   # a number (written in its column's notation), or · for a hidden key
        return float(value) if value is not None else "·"

    rope = xb.dq_turned_back is not None   # q and k are the turned ones
    capped = xb.slope is not None           # the softmax took the capped scores
    dname = "dcapped" if capped else "dscaled"   # the gradient of the softmax's input

    softmax_rows = [[keys[s], num(x.weights[s] if x.visible[s] else None),
                     num(xb.dweights[s] if x.visible[s] else None),
                     num(xb.dweights_centred[s] if x.visible[s] else None),
                     num((xb.dcapped if capped else xb.dscaled)[s] if x.visible[s] else None),
                     *([num(xb.slope[s] if x.visible[s] else None)] if capped else []),
                     num(xb.dscores[s] if x.visible[s] else None)]
                    for s in range(len(keys))]
    views = [
        Text("backward, from dcontext = d loss / d context, the backward pass's for this query",
             style="bold"),
        table(xb.dcontext[None, :], None, ["dcontext"], dims),
        Text("6. dcontext_i x v_i, and their sum: d loss / d weight, one per key", style="bold"),
        table(np.column_stack([xb.dproducts[seen], xb.dweights[seen]]), None,
              [f"dc·v {k}" for k in shown], dims + ["dweight"]),
        Text(f"7. the softmax's backward: {dname} = weight x (dweight - S)", style="bold"),
        Text(f"S = Σ weight x dweight = {xb.weighted_sum:.{precision + 4}g};  dscore = {dname} "
             + ("x slope " if capped else "")
             + ("/ sqrt(d_head)" if scale_by == "1/sqrt(d_head)" else f"x {scale_by}")
             + (", the cap's slope = 1 - (capped / C)^2" if capped else "")),
        render.record_table(["key", "weight", "dweight", "dweight - S", dname,
                             *(["slope"] if capped else []), "dscore"], softmax_rows,
                            precision=precision),
        Text(offs["dscaled"].sentence("differs"), style="dim"),
        Text("8. dscore x k, and their sum: dq", style="bold"),
        table(np.vstack([xb.dq_parts[seen], xb.dq]), None,
              [f"ds·k {k}" for k in shown] + ["Σ dq"], dims),
        Text(offs["dq"].sentence(f"differs from the backward pass's own ({q_name})") + ", "
             + offs["dq_numeric"].sentence("from central differences of sum(dcontext * "
                                           "context)"), style="dim"),
        *([Text(f"8b. RoPE's turn back at position {t}: dq cos - rotate_half(dq) sin, the "
                f"gradient of q before its turn", style="bold"),
           table(xb.dq_turned_back[None, :], None, ["dq before"], dims),
           Text(offs["dq_turned_back"].sentence(f"differs from the backward pass's own "
                                                f"({before})"), style="dim")] if rope else []),
        Text("9. this query's share of each key's gradients: dk += dscore x q, dv += weight x "
             "dcontext (every query's shares sum to the backward's dk and dv)", style="bold"),
        table(np.column_stack([xb.dk_share[seen], xb.dv_share[seen]]), None, shown,
              [f"dk {i}" for i in dims] + [f"dv {i}" for i in dims]),
    ]
    if not xb.dcontext.any():
        views.append(Text(f"dcontext is 0 here: nothing the loss counts depends on position "
                          f"{t} of row {row} through this head (padding, or no target), so no "
                          f"gradient flows", style="dim"))
    return views
