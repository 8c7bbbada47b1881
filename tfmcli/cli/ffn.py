"""tfm ffn: one feed-forward sublayer at one position, forward and backward, number by number."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (WHOLE, Position, Precision, Row, WideRows, check_indices,
                               describe, emit, execute, width)
from tfmcli.cli.options import (MODEL_OPTIONS, OUTPUT_OPTIONS, RUN_OPTIONS, Options, bounded,
                                check_range, with_options)

FORMULAS = {
    "relu": ("relu(pre) = max(pre, 0)",
             "relu'(pre) = 1 where pre > 0, else 0 (pre: the ReLU's own input)"),
    "gelu": ("gelu(pre) = 0.5 pre (1 + t),  t = tanh(sqrt(2/pi) (pre + 0.044715 pre^3))",
             "gelu'(pre) = 0.5 (1 + t) + 0.5 pre (1 - t^2) sqrt(2/pi) (1 + 3 x 0.044715 pre^2)"),
}


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def ffn(
    block: Annotated[int, typer.Option("--block", callback=bounded(0), help="Block of the feed-forward sublayer.")] = 0,
    row: Row = 0,
    position: Position = 0,
    precision: Precision = 4,
    full: WideRows = False,
    opts: Options = None,
):
    """One feed-forward sublayer at one position, number by number: pre, activation, out; then dout to dx.

    Example: tfm ffn --position 2 --activation gelu
    """
    from tfmcli.feedforward import explain, input_name
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row, None, block)
        check_range(position, cfg.seq_len, "--position", "positions")

    run, fwd, grads = execute(opts, with_grads=True, validate=validate)
    cfg = run.cfg
    p = f"blocks.{block}.ffn."
    x = explain(run.params, fwd, grads.acts[p + "out"], cfg, block, row, position)
    model = {"pre": fwd.acts[p + "pre"], "act": fwd.acts[p + "act"], "out": fwd.acts[p + "out"]}
    forward_off = max(float(np.abs(model[name][row, position] - mine).max())
                      for name, mine in (("pre", x.pre), ("act", x.hidden), ("out", x.out)))
    backward_off = max(float(np.abs(grads.acts[p + name][row, position] - mine).max())
                       for name, mine in (("act", x.dhidden), ("pre", x.dpre)))
    slope_off = float(np.abs(x.numeric_slope - x.slope).max())
    dx_off = float(np.abs(x.numeric_dx - x.dx).max())
    token = run.token_labels(row)[position]
    act, (act_formula, slope_formula) = cfg.activation, FORMULAS[cfg.activation]

    def table(rows: dict):   # every column, wrapped in blocks, up to 32 (or with --full)
        size = next(iter(rows.values())).size
        return render.tensor_table(np.vstack(list(rows.values())), row_labels=list(rows),
                                   precision=precision, width=width(), full=full or size <= WHOLE)

    def parts():
        views = [
            render.config_panel(describe(cfg, run, row), title=f"tfm ffn: block {block}, batch "
                                                               f"row {row}, position {position}"),
            Text(f"forward, at position {position} (token {token}): out = {act}(x W_1 + b_1) "
                 f"W_2 + b_2", style="bold"),
            Text(f"x = {input_name(cfg, block)} at this position (d {x.x.size});  pre = x W_1 + "
                 f"b_1 (d_ff {x.pre.size})"),
            Text(act_formula),
            table({"x": x.x}),
            table({"pre": x.pre, f"{act}(pre)": x.hidden}),
            table({"out": x.out}),
            Text(f"the model's own pre, act and out (ffn.pre, ffn.act, ffn.out) differ from "
                 f"these by {forward_off:.1e}", style="dim"),
            Text("backward: dout = d loss / d out, from the backward pass", style="bold"),
            Text("dhidden = dout W_2^T"),
            Text(slope_formula),
            Text(f"dpre = dhidden * {act}'(pre), after the product with W_2^T;  dx = dpre W_1^T"),
            table({"dout": x.dout}),
            table({"dhidden": x.dhidden, f"{act}'(pre)": x.slope, "dpre": x.dpre}),
            table({"dx": x.dx}),
            Text(f"dhidden and dpre differ from the backward pass's own by {backward_off:.1e}; "
                 f"{act}'(pre) from central differences of {act} by {slope_off:.1e}; dx from "
                 f"central differences of sum(dout * FFN(x)) by {dx_off:.1e}", style="dim"),
            Text("this position's part of dW_1 is x^T dpre (the outer product, d x d_ff), of "
                 "db_1 dpre; of dW_2 hidden^T dout, of db_2 dout", style="bold")]
        if not x.dout.any():
            views.append(Text(f"dout is 0 here: position {position} of row {row} adds nothing "
                              f"to the loss through this block (padding, or no target), so no "
                              f"gradient flows", style="dim"))
        return views

    payload = {"block": block, "row": row, "position": position, "token": token,
               "activation": act, "input": input_name(cfg, block), "x": x.x.tolist(),
               "pre": x.pre.tolist(), "hidden": x.hidden.tolist(), "out": x.out.tolist(),
               "forward_model_diff": forward_off, "dout": x.dout.tolist(),
               "dhidden": x.dhidden.tolist(), "slope": x.slope.tolist(), "dpre": x.dpre.tolist(),
               "dx": x.dx.tolist(), "backward_model_diff": backward_off,
               "slope_numeric_diff": slope_off, "dx_numeric_diff": dx_off}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
