"""tfm backward: forward, the hand-written backward, and one row per parameter gradient."""

import json
from collections import ChainMap
from enum import Enum
from typing import Annotated, Optional

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Full,
    Precision,
    Row,
    Show,
    check_indices,
    check_show,
    describe,
    emit,
    execute,
    rows_limit,
    show_tensors,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    choice,
    with_options,
)
from tfmcli.engine import sizes
from tfmcli.errors import TfmError
from tfmcli.explain.summary import l2_norm, max_abs, mean

Layer = Enum("Layer", {name: name for name in ("embed", "ln_embed", "attn", "ln1", "ln1_post",
                                               "ln2", "ffn", "ln2_post", "ln_f", "head", "all")},
             type=str)


def layer_of(name: str) -> str:
    """'blocks.0.ffn.W_1' -> 'ffn'; 'embed.W_E' -> 'embed'."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blocks" else parts[0]


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def backward(
    layer: Annotated[Layer, choice(
        "--layer", choices=Layer, help="Only this layer's parameters.")] = Layer.all,
    block: Annotated[Optional[int], typer.Option(
        "--block", callback=bounded(0), help="Only this block's parameters.")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Add the central-difference error of each parameter.")] = False,
    show: Show = None,
    row: Row = 0,
    head: Annotated[int, typer.Option(
        "--head", callback=bounded(0), help="Head of a 4-D --show tensor.")] = 0,
    precision: Precision = 4,
    full: Full = False,
    opts: Options = None,
):
    """Forward + hand-written backward: a gradient table per parameter (and --check).

    Example: tfm backward --layer ffn --check --show dlogits
    """
    from tfmcli.cli.checks import default_max_entries, run_gradcheck, verdict
    from tfmcli.io import run_arrays

    layer = layer.value
    names = []

    def validate(cfg):
        check_indices(cfg, row, head, block)
        check_show(cfg, show, gradient=True)
        if not show and opts.explicit("head"):   # the table has whole parameters, no heads
            raise typer.BadParameter("it picks the head of a 4-D --show tensor; give --show "
                                     "too (--show dblocks.0.attn.pattern --head 1)",
                                     param_hint="'--head'")
        if layer == "ln_f" and cfg.norm == "post":
            raise typer.BadParameter("Post-LN has no ln_f; use --norm pre", param_hint="'--layer'")
        names.extend(n for n in sizes.param_shapes(cfg)
                     if (layer == "all" or layer_of(n) == layer)
                     and (block is None or n.startswith(f"blocks.{block}.")))
        if not names:
            where = "" if block is None else f" in block {block}"
            raise typer.BadParameter(f"this model has no parameter of layer {layer!r}{where}",
                                     param_hint="'--layer'")

    def keep(run):   # streamed: the --show tensors whole, every other gradient summarised
        return check_show(run.cfg, show, gradient=True)

    run, fwd, grads = execute(
        opts, with_grads=True, validate=validate, keep=None if check else keep, held=keep,
        whole="--check nudges each weight and runs the whole model again, so it holds it all")
    cfg, params, inputs = run.cfg, run.params, run.inputs
    report = None
    if check:
        report = run_gradcheck(params, inputs, cfg, names, default_max_entries(cfg), None, None)
    checks = {c.name: c for c in report.params} if report else None
    # --show: a parameter's gradient by its name, an activation's by its name (or 'd' + name)
    shown, shown_json = show_tensors(ChainMap(grads.acts, grads), show, precision, row, head,
                                     run, gradient=True)
    def parts():   # drawn only without --json
        return [render.config_panel(describe(cfg, run, row), title="tfm backward"),
                render.grad_table({n: grads[n] for n in names}, checks, precision=precision,
                                  max_rows=rows_limit(full),
                                  rope=cfg.pe == "rope"),
                *shown, Text(f"loss = {fwd.loss:.{precision + 2}f}", style="bold"),
                *([verdict(report)] if report is not None else [])]
    payload = lambda: {   # noqa: E731  (computed only for --json)
        "config": json.loads(cfg.to_json()), "loss": fwd.loss,
        "gradients": [grad_row(n, grads[n], checks) for n in names], "show": shown_json}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd, grads))
    if report is not None and not report.passed:
        raise TfmError(f"gradcheck failed for {', '.join(report.failed)}")


def grad_row(name, g, checks):
    row = {"name": name, "shape": list(g.shape), "l2": l2_norm(g),
           "max_abs": max_abs(g), "mean": mean(g)}
    if checks and name in checks:
        row.update(rel_err=checks[name].rel_err, passed=checks[name].passed)
    return row
