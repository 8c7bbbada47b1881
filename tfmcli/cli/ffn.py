"""tfm ffn: one feed-forward sublayer at one position, forward and backward, number by number."""

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
    WideRows,
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
from tfmcli.cli.streaming import block_tensors

FORMULAS = {
    "relu": ("relu(pre) = max(pre, 0)",
             "relu'(pre) = 1 where pre > 0, else 0 (pre: the ReLU's own input)"),
    "gelu": ("gelu(pre) = 0.5 pre (1 + t),  t = tanh(sqrt(2/pi) (pre + 0.044715 pre^3))",
             "gelu'(pre) = 0.5 (1 + t) + 0.5 pre (1 - t^2) sqrt(2/pi) (1 + 3 x 0.044715 pre^2)"),
    "gelu_erf": ("gelu_erf(pre) = pre Phi(pre) = 0.5 pre (1 + erf(pre / sqrt 2))",
                 "gelu_erf'(pre) = Phi(pre) + pre phi(pre),  phi(pre) = exp(-pre^2 / 2) / "
                 "sqrt(2 pi)"),
    "swiglu": ("silu(gate) = gate sigmoid(gate) = gate / (1 + exp(-gate));  hidden = silu(gate) "
               "* pre",
               "silu'(gate) = s (1 + gate (1 - s)),  s = sigmoid(gate)"),
    "geglu": ("gelu(gate) = 0.5 gate (1 + t),  t = tanh(sqrt(2/pi) (gate + 0.044715 gate^3));  "
              "hidden = gelu(gate) * pre",
              "gelu'(gate) = 0.5 (1 + t) + 0.5 gate (1 - t^2) sqrt(2/pi) (1 + 3 x 0.044715 "
              "gate^2)"),
    "geglu_erf": ("gelu_erf(gate) = gate Phi(gate) = 0.5 gate (1 + erf(gate / sqrt 2));  "
                  "hidden = gelu_erf(gate) * pre",
                  "gelu_erf'(gate) = Phi(gate) + gate phi(gate),  phi(gate) = exp(-gate^2 / 2) "
                  "/ sqrt(2 pi)"),
}


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def ffn(
    block: Annotated[int, typer.Option(
        "--block", callback=bounded(0), help="Block of the feed-forward sublayer.")] = 0,
    row: Row = 0,
    position: Position = 0,
    precision: Precision = 4,
    full: WideRows = False,
    opts: Options = None,
):
    """One feed-forward sublayer at one position: pre, activation, out; then dout to dx.

    With --activation swiglu, the gate too: silu(gate) * pre, dgate beside dpre
    (geglu: gelu(gate) * pre).

    Example: tfm ffn --position 2 --activation gelu
    """
    from tfmcli.explain.feedforward import GATE_UNITS, explain, input_name
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row, None, block)
        check_range(position, cfg.seq_len, "--position", "positions")

    run, fwd, grads = execute(opts, with_grads=True, validate=validate,
                              keep=lambda run: block_tensors(run.cfg, block),
                              held=lambda run: block_tensors(run.cfg, block))
    cfg = run.cfg
    p = f"blocks.{block}.ffn."
    x = explain(run.params, fwd, grads.acts[p + "out"], cfg, block, row, position)
    gated = x.gate is not None   # SwiGLU, GeGLU
    forward_mine = {"pre": x.pre, "act": x.hidden, "out": x.out,
                    **({"gate": x.gate} if gated else {})}
    from tfmcli.explain.cells import agreement

    def beside(mine: dict, tensors, what: str):   # the working beside the run's own
        return agreement(fwd, what, np.concatenate(list(mine.values())),
                         np.concatenate([tensors[p + name][row, position] for name in mine]),
                         [p + name for name in forward_mine])

    backward_mine = {"act": x.dhidden, "pre": x.dpre, **({"gate": x.dgate} if gated else {})}
    backward_check = beside(backward_mine, grads.acts, "dhidden, dpre and dgate" if gated
                            else "dhidden and dpre")
    backward_off = backward_check.off
    slope_off = float(np.abs(x.numeric_slope - x.slope).max())
    dx_off = float(np.abs(x.numeric_dx - x.dx).max())
    token = run.token_labels(row)[position]
    act, (act_formula, slope_formula) = cfg.activation, FORMULAS[cfg.activation]
    unit = GATE_UNITS.get(act, act)   # silu or gelu on a gated FFN's gate
    slope_name = f"{unit}'(gate)" if gated else f"{act}'(pre)"
    mine_names = ("ffn.gate, ffn.pre, ffn.act and ffn.out" if gated else
                  "pre, act and out (ffn.pre, ffn.act, ffn.out)")
    forward_check = beside(forward_mine, fwd.acts, f"the model's own {mine_names}")
    forward_off = forward_check.off

    def b(name):   # the bias term of a formula, in a model whose FFN has biases
        return f" + b_{name}" if cfg.ffn_biased else ""

    def plain_forward():
        return [
            Text(f"forward, at position {position} (token {token}): out = {act}(x W_1{b(1)}) "
                 f"W_2{b(2)}", style="bold"),
            Text(f"x = {input_name(cfg, block)} at this position (d {x.x.size});  pre = x "
                 f"W_1{b(1)} (d_ff {x.pre.size})"),
            Text(act_formula),
            table({"x": x.x}),
            table({"pre": x.pre, f"{act}(pre)": x.hidden})]

    def gated_forward():
        return [
            Text(f"forward, at position {position} (token {token}): out = ({unit}(x "
                 f"W_gate{b('gate')}) * (x W_1{b(1)})) W_2{b(2)}", style="bold"),
            Text(f"x = {input_name(cfg, block)} at this position (d {x.x.size});  gate = x "
                 f"W_gate{b('gate')}, pre = x W_1{b(1)} (d_ff {x.pre.size})"),
            Text(act_formula),
            table({"x": x.x}),
            table({"gate": x.gate, f"{unit}(gate)": x.gate_act, "pre": x.pre,
                   "hidden": x.hidden})]

    def plain_backward():
        return [
            Text(f"dpre = dhidden * {act}'(pre), after the product with W_2^T;  dx = dpre W_1^T"),
            table({"dout": x.dout}),
            table({"dhidden": x.dhidden, f"{act}'(pre)": x.slope, "dpre": x.dpre})]

    def gated_backward():
        return [
            Text(f"dpre = dhidden * {unit}(gate);  dgate = dhidden * pre * {unit}'(gate) (the "
                 f"product rule: each factor's gradient holds the other);  dx = dpre W_1^T + "
                 f"dgate W_gate^T"),
            table({"dout": x.dout}),
            table({"dhidden": x.dhidden, f"{unit}'(gate)": x.slope, "dpre": x.dpre,
                   "dgate": x.dgate})]

    def table(rows: dict):   # every column, wrapped in blocks, up to 32 (or with --full)
        size = next(iter(rows.values())).size
        return render.tensor_table(np.vstack(list(rows.values())), row_labels=list(rows),
                                   notation_by="row",
                                   precision=precision, width=width(), full=full or size <= WHOLE)

    def parts():
        views = [
            render.config_panel(describe(cfg, run, row), title=f"tfm ffn: block {block}, batch "
                                                               f"row {row}, position {position}"),
            *(gated_forward() if gated else plain_forward()),
            table({"out": x.out}),
            Text(forward_check.sentence("differ from these"), style="dim"),
            Text("backward: dout = d loss / d out, from the backward pass", style="bold"),
            Text("dhidden = dout W_2^T"),
            Text(slope_formula),
            *(gated_backward() if gated else plain_backward()),
            table({"dx": x.dx}),
            Text(backward_check.sentence("differ from the backward pass's own")
                 + f"; {slope_name} from central differences of {unit} by {slope_off:.1e}; dx "
                 f"from central differences of sum(dout * FFN(x)) by {dx_off:.1e}",
                 style="dim"),
            Text(weight_parts(gated, cfg.ffn_biased), style="bold")]
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
    if gated:   # SwiGLU: hidden is silu(gate) * pre, slope silu'(gate); GeGLU: gelu
        payload.update({"gate": x.gate.tolist(), "dgate": x.dgate.tolist()})
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))


def weight_parts(gated: bool, bias: bool) -> str:
    """What this position adds to each weight's gradient, and to each bias's when the FFN has
    biases (``Config.ffn_biased``)."""
    layers = [("W_gate", "x^T dgate", "dgate")] if gated else []
    layers += [("W_1", "x^T dpre", "dpre"), ("W_2", "hidden^T dout", "dout")]
    said = []
    for i, (w, outer, grad) in enumerate(layers):
        text = f"d{w} is {outer} (the outer product, d x d_ff)" if i == 0 else f"d{w} {outer}"
        said.append(text + (f", of d{w.replace('W', 'b')} {grad}" if bias else ""))
    return "this position's part of " + "; of ".join(said)
