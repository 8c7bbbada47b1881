"""tfm adam: a few entries of one parameter through a few Adam steps, every term of the update."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Precision, Rate, Warmup, check_rate, describe, emit, execute, width
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    bounded,
    check_memory,
    check_name,
    with_options,
)
from tfmcli.errors import TfmError


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, OUTPUT_OPTIONS)
def adam(
    param: Annotated[str, typer.Option(
        "--param", metavar="NAME",
        help="The parameter whose entries are followed.")] = "blocks.0.ffn.W_1",
    steps: Annotated[int, typer.Option(
        "--steps", callback=bounded(1, 10), help="Updates on the run's batch (1..10).")] = 3,
    top: Annotated[int, typer.Option(
        "-k", "--top", callback=bounded(1, 8), help="Entries: the largest gradients (1..8).")] = 4,
    warmup: Warmup = 100,
    lr: Rate = None,
    precision: Precision = 4,
    opts: Options = None,
):
    """Adam by hand: a few entries through a few updates, m, v, their corrections and the step.

    Example: tfm adam --param blocks.0.attn.W_Q --lr 0.01
    """
    from tfmcli.engine.sizes import param_count, param_shapes
    from tfmcli.explain.adam import explain
    from tfmcli.io import run_arrays

    check_rate(opts, lr)

    def validate(cfg):
        if not opts.values.get("force", False):   # a copy of the parameters and Adam's m and v
            check_memory(cfg, 3 * param_count(cfg) * cfg.np_dtype.itemsize,
                         "forward + backward with a copy of the parameters and Adam's moments",
                         opts=opts)
        shapes = param_shapes(cfg)
        name = check_name(param, shapes, flag="--param")
        size = int(np.prod(shapes[name]))
        if top > size:
            raise typer.BadParameter(f"{name} has {size} entries; -k picks at most that many",
                                     param_hint="'-k'")

    run, _, _ = execute(opts, with_grads=False, validate=validate,
                        whole="steps every weight with its gradient and Adam's two moments, so it "
                              "holds them all")
    cfg = run.cfg
    try:   # as execute: an overflow (or a NaN made) anywhere in the steps stops them
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            x = explain(run.params, run.inputs, cfg, param, steps, top, warmup, lr)
    except FloatingPointError as e:
        raise TfmError(f"training overflowed {cfg.dtype} ({e}); use a smaller --lr") from None
    labels = [f"[{','.join(map(str, e))}]" for e in x.entries]
    engine_off = max(float(np.abs(s.p - s.engine_p).max()) for s in x.steps)
    schedule = (f"constant lr {lr:g}" if lr is not None else
                f"lr = d^-0.5 min(t^-0.5, t warmup^-1.5), d {cfg.d_model}, warmup {warmup}")

    def quantities(s):
        return {"g": s.g, "m": s.m, "v": s.v, "m_hat": s.m_hat, "v_hat": s.v_hat,
                "step": s.update, "p": s.p}

    # each quantity in one notation over every step (p with p before), as one column would be
    notations = render.row_notations([quantities(s) for s in x.steps] + [{"p": x.p0}])
    notations["p before"] = notations["p"]

    def table(rows: dict):
        return render.tensor_table(np.vstack(list(rows.values())), row_labels=list(rows),
                                   col_labels=labels, precision=precision, width=width(),
                                   full=True, notation_by="row", notations=notations)

    def tokens_named():   # W_E's rows are tokens: say which, when they have a text of their own
        ids = sorted({e[0] for e in x.entries}) if param == "embed.W_E" else []
        named = [f"{i}: {run.token_text(i)}" for i in ids if run.token_text(i) != str(i)]
        return f" (row{'s' * (len(named) > 1)} {', '.join(named)})" if named else ""

    def parts():
        views = [
            render.config_panel(describe(cfg, run), title=f"tfm adam: {param}, {steps} "
                                                          f"step{'s' * (steps > 1)}"),
            Text("Adam on this run's own batch (beta1 0.9, beta2 0.98, eps 1e-9):", style="bold"),
            Text("m = 0.9 m + 0.1 g,  v = 0.98 v + 0.02 g^2,  m_hat = m / (1 - 0.9^t),  "
                 "v_hat = v / (1 - 0.98^t),  step = lr m_hat / (sqrt(v_hat) + eps),  "
                 "p = p - step"),
            Text(schedule),
            Text(f"the {len(labels)} entries of {param} with the largest gradient at step 1"
                 + tokens_named()),
            table({"p before": x.p0})]
        for s in x.steps:
            views += [
                Text(f"step {s.t}: lr {s.lr:.{precision}e}, loss before it "
                     f"{s.loss:.{precision + 2}f}", style="bold"),
                table(quantities(s))]
            if s.t == 1:
                views.append(Text("at t = 1 the corrections make m_hat = g and v_hat = g^2: "
                                  "each entry moves by lr g / (|g| + eps), about lr whatever "
                                  "the size of its gradient", style="dim"))
        losses = [s.loss for s in x.steps] + [x.final.loss]
        views += [
            Text("loss: " + " → ".join(f"{value:.{precision + 2}f}" for value in losses)),
            Text(f"p differs from what tfmcli.train.optim.adam_step leaves (every parameter, in "
                 f"{cfg.dtype}) by {engine_off:.1e}", style="dim")]
        return views

    payload = {"param": param, "entries": [list(e) for e in x.entries], "p0": x.p0.tolist(),
               "lr": lr, "warmup": None if lr is not None else warmup,
               "steps": [{"t": s.t, "lr": s.lr, "loss": s.loss, "g": s.g.tolist(),
                          "m": s.m.tolist(), "v": s.v.tolist(), "m_hat": s.m_hat.tolist(),
                          "v_hat": s.v_hat.tolist(), "step": s.update.tolist(),
                          "p": s.p.tolist(), "engine_p": s.engine_p.tolist()}
                         for s in x.steps],
               "final_loss": x.final.loss, "engine_diff": engine_off}
    emit(opts, parts, payload, run_arrays(cfg, x.params, run.inputs, x.final))
