"""tfm attribute: direct logit attribution, one token's logit at one position as the sum of
what each head, FFN, bias and the embedding wrote into the residual stream."""

from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Position,
    Row,
    check_indices,
    check_range,
    describe,
    emit,
    execute,
    token_id,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    bounded,
    with_options,
)
from tfmcli.errors import TfmError


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def attribute(
    row: Row = 0,
    position: Position = 0,
    target: Annotated[Optional[str], typer.Option(
        "--target", metavar="ID|TEXT",
        help="The token whose logit (default: the position's target, else the top one).")
    ] = None,
    top: Annotated[int, typer.Option(
        "-k", "--top", callback=bounded(1), help="Terms listed; the rest summed.")] = 12,
    opts: Options = None,
):
    """Direct logit attribution: one logit as the sum of what each head, FFN and bias added.

    Example: tfm attribute --tokens 3,1,4,1,5 -t 2 -L 2
    """
    from tfmcli.explain.attribution import attribute as attribution
    from tfmcli.explain.attribution import undecomposable

    def validate(cfg):
        check_indices(cfg, row)
        check_range(position, cfg.seq_len, "--position", "positions")

    run, fwd, _ = execute(opts, with_grads=False, validate=validate)
    cfg = run.cfg
    why = undecomposable(cfg)
    if why is not None:
        raise TfmError(why)
    if position >= int(run.inputs.lengths[row]):
        raise typer.BadParameter(f"position {position} of row {row} is padding (the row has "
                                 f"{int(run.inputs.lengths[row])} tokens)",
                                 param_hint="'--position'")
    token = token_id(run, target, "--target")
    if token is None:
        wanted = int(run.inputs.targets[row, position])
        token = wanted if wanted >= 0 else int(fwd.acts["logits"][row, position].argmax())
    result = attribution(run.params, fwd, cfg, row, position, token)
    label = f"{token}:{run.token_text(token)}"
    rows = {**describe(cfg, run, row),
            "logit of": f"{label} at position {position} ({run.token_labels(row)[position]})"}
    shown = min(top, len(result.names))
    table = Table(box=None, padding=(0, 1), show_edge=False)
    table.add_column("term", no_wrap=True)
    table.add_column("adds", justify="right", no_wrap=True)
    for name, value in zip(result.names[:shown], result.values[:shown]):
        table.add_row(name, render.fmt(value, 6))
    if shown < len(result.names):
        rest = result.values[shown:]
        table.add_row(Text(f"{len(rest)} more", style="dim"), render.fmt(float(rest.sum()), 6))
    table.add_row(Text("sum of the terms", style="bold"), render.fmt(result.total, 6))
    table.add_row(Text("the logit", style="bold"), render.fmt(result.logit, 6))
    title = Text(f"what each part adds to the logit of {label}", style="bold")
    parts = [render.config_panel(rows, title="tfm attribute"), title, table,
             Text("a term: its vector through the final norm (its scale frozen at the run's) "
                  "and the head's column of the token", style="dim")]
    if result.note:
        parts.append(Text(result.note, style="yellow"))
    payload = {"row": row, "position": position, "token": token,
               "token_text": run.token_text(token), "logit": result.logit,
               "capped": result.capped, "sum": result.total,
               "terms": [{"name": n, "value": float(v)}
                         for n, v in zip(result.names, result.values)],
               "note": result.note}
    import numpy as np

    from tfmcli.io import run_arrays

    arrays = {**run_arrays(cfg, run.params, run.inputs, fwd),   # the run, and the terms
              "attribution/names": np.array(result.names), "attribution/values": result.values}
    emit(opts, parts, payload, arrays)
