"""tfm loss: the LM head and the loss at one position, forward and backward, number by number."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    WHOLE,
    Position,
    Precision,
    Row,
    check_indices,
    describe,
    emit,
    execute,
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


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def loss(
    row: Row = 0,
    position: Position = 0,
    top: Annotated[int, typer.Option(
        "-k", "--top", callback=bounded(1, 32),
        help="With more than 32 tokens in the vocabulary: how many of the likeliest to show beside "
             "the target.")] = 8,
    precision: Precision = 4,
    opts: Options = None,
):
    """The head and the loss at one position: logits, softmax, -log p; then (p - y) / N to dh.

    Example: tfm loss --position 2
    """
    from tfmcli.explain.loss import explain, input_name, shown_ids
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row)
        check_range(position, cfg.seq_len, "--position", "positions")
        if opts.explicit("top") and cfg.vocab <= WHOLE:
            raise typer.BadParameter(f"a vocabulary of {cfg.vocab} is shown whole; -k picks "
                                     f"tokens only above {WHOLE}", param_hint="'-k'")

    run, fwd, grads = execute(opts, with_grads=True, validate=validate, keep=lambda run: set())
    cfg = run.cfg
    x = explain(run.params, fwd, cfg, row, position)
    from tfmcli.explain.cells import agreement

    forward_check = agreement(
        fwd, "the model's own logits and probs", np.concatenate([x.logits, x.probs]),
        np.concatenate([fwd.acts[name][row, position] for name in ("logits", "probs")]),
        ["logits"])
    # the head's output changed: its gradients no longer follow from the softmax alone
    dlogits_check = agreement(fwd, "dlogits", x.dlogits, grads.acts["logits"][row, position],
                              ["logits"])
    dh_check = agreement(fwd, "dh", x.dh, grads.acts[input_name(cfg)][row, position],
                         ["logits"])
    forward_off, dlogits_off, dh_off = forward_check.off, dlogits_check.off, dh_check.off
    dh_numeric_off = float(np.abs(x.numeric_dh - x.dh).max())
    token = run.token_labels(row)[position]
    ids = shown_ids(x.probs, x.target, top, WHOLE)
    labels = [("y=" if i == x.target else "") + run.token_text(i) for i in ids]
    p = "p[target]"
    cap = cfg.logit_softcap   # the logits are C tanh(z / C) of the head's z
    c = f"{cap:g}" if cap is not None else ""
    dz = "dlogits" if cap is None else "dz"   # what the head's backward takes

    def vocab_table(rows: dict, caption=None):
        return render.tensor_table(np.vstack([v[ids] for v in rows.values()]),
                                   row_labels=list(rows), col_labels=labels, caption=caption,
                                   precision=precision, width=width(), full=True,
                                   notation_by="row")

    def parts():
        if x.target is None:
            where = (f"position {position} (token {token}) has no target (padding, or the "
                     f"row's last token): it adds nothing to the loss")
        else:
            text = run.token_text(x.target)
            where = (f"position {position} (token {token}): the target y is the next token, "
                     f"{text}" + ("" if text == str(x.target) else f" (id {x.target})"))
        columns = (None if len(ids) == cfg.vocab else
                   f"columns: {'the target and ' if x.target is not None else ''}the "
                   f"{len(ids) - (x.target is not None)} likeliest of {cfg.vocab} tokens (-k)")
        views = [
            render.config_panel(describe(cfg, run, row),
                                title=f"tfm loss: batch row {row}, position {position}"),
            Text(("forward: logits = h W_U + b_U" if cap is None else
                  f"forward: z = h W_U + b_U, logits = {c} tanh(z / {c}) (the cap)")
                 + f", p = softmax(logits), the loss term -log {p}", style="bold"),
            Text(where),
            Text(f"h = {input_name(cfg)} at this position (d {x.h.size})"),
            render.tensor_table(x.h[None, :], row_labels=["h"], precision=precision,
                                width=width(), full=x.h.size <= WHOLE),
            Text(f"p = exp(logits - max) / sum:  max = {x.top:.{precision + 4}g},  sum = "
                 f"{x.total:.{precision + 4}g}"),
            vocab_table({**({"z": x.z} if cap is not None else {}), "logits": x.logits,
                         "logits - max": x.shifted, "exp": x.exps, "p": x.probs}, columns),
            Text(forward_check.sentence("differ from these"), style="dim")]
        if x.target is not None:
            views += [
                Text(f"-log {p} = log(sum) - (logits[target] - max) = "
                     f"{x.term:.{precision + 4}g}"),
                Text(f"the loss is the mean of N = {x.n} such terms: this one adds "
                     f"{x.term_share:.{precision + 4}g}"),
                Text("backward: dlogits = (p - y) / N, y = 1 at the target and 0 elsewhere",
                     style="bold"),
                vocab_table({"p - y": x.p_minus_y, "dlogits": x.dlogits,
                             **({"slope": x.slope, "dz": x.dz} if cap is not None else {})},
                            columns),
                Text((f"back through the cap: dz = dlogits x slope, slope = 1 - (logits / {c})^2; "
                      if cap is not None else "")
                     + f"dh = {dz} W_U^T" + (f" (tied: W_U = W_E^T, so dh = {dz} W_E)"
                                             if cfg.tied_head else "")),
                render.tensor_table(x.dh[None, :], row_labels=["dh"], precision=precision,
                                    width=width(), full=x.dh.size <= WHOLE),
                Text(dlogits_check.sentence("differs from the backward pass's own")
                     + "; " + dh_check.sentence(f"from its gradient of {input_name(cfg)}")
                     + f", and from central differences of -log {p} / N by "
                     f"{dh_numeric_off:.1e}",
                     style="dim"),
                Text("this position's part of " + (f"W_E's gradient is {dz}^T h (V x d)"
                                                    if cfg.tied_head else
                                                    f"dW_U is h^T {dz} (d x V)")
                     + (f", of db_U {dz}" if cfg.head_bias else ""), style="bold")]
        else:
            views.append(Text("no target, so dlogits and dh are 0 here", style="dim"))
        return views

    payload = {"row": row, "position": position, "token": token, "target": x.target,
               "n": x.n, "input": input_name(cfg), "h": x.h.tolist(),
               "logits": x.logits.tolist(), "max": x.top, "sum": x.total,
               "probs": x.probs.tolist(), "term": x.term, "forward_model_diff": forward_off,
               "dlogits": x.dlogits.tolist(), "dh": x.dh.tolist(),
               "dlogits_model_diff": dlogits_off, "dh_model_diff": dh_off,
               "dh_numeric_diff": dh_numeric_off, "shown": ids,
               **({"z": x.z.tolist(), "dz": x.dz.tolist()} if cap is not None else {})}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
