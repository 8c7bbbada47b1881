"""tfm ln: one layer norm at one position, forward and backward, number by number."""

from enum import Enum
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
    choice,
    with_options,
)
from tfmcli.cli.streaming import block_tensors

Which = Enum("Which", {name: name for name in ("ln1", "ln1_post", "ln2", "ln2_post", "ln_f",
                                               "ln_embed")}, type=str)


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def ln(
    layer: Annotated[Which, choice(
        "--layer", choices=Which, metavar="NAME", show_default=False,
        help="ln1 (default), ln2, ln_f, ln1_post, ln2_post, ln_embed")] = Which.ln1,
    block: Annotated[int, typer.Option(
        "--block", callback=bounded(0), help="Block of the layer norm.")] = 0,
    row: Row = 0,
    position: Position = 0,
    precision: Precision = 4,
    full: Annotated[bool, typer.Option("--full", help="Every column (else up to 32).")] = False,
    opts: Options = None,
):
    """One layer norm at one position, number by number: x, mean, variance, xhat, y; then dy to dx.

    With --rms-norm, RMSNorm's (no mean, no beta); with --no-norm-bias, no beta.

    Example: tfm ln --layer ln2 --position 3
    """
    from tfmcli.explain.layernorm import explain
    from tfmcli.io import run_arrays

    top = layer in (Which.ln_f, Which.ln_embed)   # one of the model's, not a block's
    name = layer.value if top else f"blocks.{block}.{layer.value}"

    def validate(cfg):
        check_indices(cfg, row, None, block)
        check_range(position, cfg.seq_len, "--position", "positions")
        if layer == Which.ln_f and cfg.norm == "post":
            raise typer.BadParameter("Post-LN has no ln_f; use --norm pre", param_hint="'--layer'")
        if layer.value.endswith("_post") and not cfg.sandwich_norm:
            raise typer.BadParameter(f"this model has no {layer.value}: only a sandwich norm "
                                     f"normalises each sublayer's output; add --sandwich-norm",
                                     param_hint="'--layer'")
        if layer == Which.ln2 and cfg.shared_norm:
            raise typer.BadParameter("this model has no ln2: its one norm a block, ln1, feeds "
                                     "attention and the FFN (--shared-norm); use --layer ln1",
                                     param_hint="'--layer'")
        if layer == Which.ln_embed and not cfg.embed_norm:
            raise typer.BadParameter("this model has no ln_embed: add --embed-norm",
                                     param_hint="'--layer'")
        if top and opts.explicit("block"):
            where = "follows the last block" if layer == Which.ln_f else "comes before block 0"
            raise typer.BadParameter(f"{layer.value} {where}; it takes no --block",
                                     param_hint="'--block'")

    here = None if top else block   # streamed: the block's tensors whole (ln_f's, the embed's
    #                                 norm's are kept)
    run, fwd, grads = execute(opts, with_grads=True, validate=validate,
                              keep=lambda run: block_tensors(run.cfg, here),
                              held=lambda run: block_tensors(run.cfg, here))
    cfg = run.cfg
    x = explain(run.params, fwd, grads.acts[name + ".out"], cfg, name, row, position)
    from tfmcli.explain.cells import agreement

    y_check = agreement(fwd, f"the model's own y ({name}.out)", x.y,
                        fwd.acts[name + ".out"][row, position], [name + ".out"])
    y_off = y_check.off
    dx_off = float(np.abs(x.numeric_dx - x.dx).max())
    token = run.token_labels(row)[position]

    def table(rows: dict):   # every column, wrapped in blocks, up to d 32 (or with --full)
        return render.tensor_table(np.vstack(list(rows.values())), row_labels=list(rows),
                                   notation_by="row",
                                   precision=precision, width=width(),
                                   full=full or x.x.size <= WHOLE)

    def rms_parts(d):   # RMSNorm: no mean taken out, no beta
        return [
            Text(f"forward, at position {position} (token {token}): y = gamma * x / "
                 f"sqrt(mean(x^2) + eps)  (RMSNorm: no mean taken out, no beta)", style="bold"),
            Text(f"mean(x^2) = sum(x^2) / {d} = {x.var:.{precision + 4}g};  sqrt(mean(x^2) + "
                 f"eps) = {x.std:.{precision + 4}g}  (eps {cfg.eps:g})"),
            table({"x": x.x, "xhat": x.xhat, "gamma": x.gamma, "y": x.y}),
            Text(y_check.sentence(), style="dim"),
            Text("backward: dy = d loss / d y, from the backward pass; dxhat = dy * gamma",
                 style="bold"),
            Text(f"m2 = mean(dxhat * xhat) = {x.mean_dxhat_xhat:.{precision + 4}g}  (no m1 = "
                 f"mean(dxhat): no mean was taken out)"),
            table({"dy": x.dy, "dxhat": x.dxhat, "xhat * m2": x.xhat_scaled, "dx": x.dx}),
            Text("dx = (dxhat - xhat * m2) / sqrt(mean(x^2) + eps);  this position's part of "
                 "dgamma is dy * xhat", style="bold"),
            Text(f"dx differs from central differences of sum(dy * y) by {dx_off:.1e}",
                 style="dim")]

    def layer_norm_parts(d):
        beta = ({"beta": x.beta} if x.has_beta else {})   # none with --no-norm-bias (MPT's)
        return [
            Text(f"forward, at position {position} (token {token}): y = gamma * (x - mean) / "
                 f"sqrt(var + eps)" + (" + beta" if x.has_beta else "  (no beta: --no-norm-bias)"),
                 style="bold"),
            Text(f"mean = sum(x) / {d} = {x.mean:.{precision + 4}g};  var = sum((x - mean)^2) "
                 f"/ {d} = {x.var:.{precision + 4}g};  sqrt(var + eps) = "
                 f"{x.std:.{precision + 4}g}  (eps {cfg.eps:g})"),
            table({"x": x.x, "x - mean": x.centred, "xhat": x.xhat, "gamma": x.gamma,
                   **beta, "y": x.y}),
            Text(y_check.sentence(), style="dim"),
            Text("backward: dy = d loss / d y, from the backward pass; dxhat = dy * gamma",
                 style="bold"),
            Text(f"m1 = mean(dxhat) = {x.mean_dxhat:.{precision + 4}g};  m2 = mean(dxhat * "
                 f"xhat) = {x.mean_dxhat_xhat:.{precision + 4}g}"),
            table({"dy": x.dy, "dxhat": x.dxhat, "dxhat - m1": x.dxhat_centred,
                   "xhat * m2": x.xhat_scaled, "dx": x.dx}),
            Text("dx = (dxhat - m1 - xhat * m2) / sqrt(var + eps);  this position's part of "
                 "dgamma is dy * xhat" + (", of dbeta dy" if x.has_beta else ""), style="bold"),
            Text(f"dx differs from central differences of sum(dy * y) by {dx_off:.1e}",
                 style="dim")]

    def parts():
        d = x.x.size
        views = [render.config_panel(describe(cfg, run, row), title=f"tfm ln: {name}, batch "
                                                                    f"row {row}, position "
                                                                    f"{position}"),
                 *(rms_parts(d) if x.rms else layer_norm_parts(d))]
        if not x.dy.any():
            views.append(Text(f"dy is 0 here: position {position} of row {row} adds nothing to "
                              f"the loss (padding, or no target), so no gradient flows",
                              style="dim"))
        return views

    payload = {"layer": name, "row": row, "position": position, "token": token,
               "x": x.x.tolist(), "mean": x.mean, "var": x.var, "std": x.std,
               "xhat": x.xhat.tolist(), "gamma": x.gamma.tolist(), "beta": x.beta.tolist(),
               "y": x.y.tolist(), "y_model_diff": y_off, "dy": x.dy.tolist(),
               "dxhat": x.dxhat.tolist(), "mean_dxhat": x.mean_dxhat,
               "mean_dxhat_xhat": x.mean_dxhat_xhat, "dx": x.dx.tolist(),
               "dx_numeric_diff": dx_off, "rms_norm": x.rms, "has_beta": x.has_beta}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
