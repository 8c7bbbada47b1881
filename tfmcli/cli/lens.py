"""tfm lens: the logit lens, the model's next-token guess after every block."""

from typing import Annotated

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Row, check_indices, describe, emit, execute, width
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    with_options,
)


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def lens(
    row: Row = 0,
    top: Annotated[int, typer.Option(
        "--top", "-k", callback=bounded(1, 20), help="Tokens shown per position (1..20).")] = 3,
    full: Annotated[bool, typer.Option("--full", help="Every position, however wide.")] = False,
    opts: Options = None,
):
    """The logit lens: after each block, the next tokens the model would predict there.

    Example: tfm lens --tokens 3,1,4,1,5 -L 3
    """
    from tfmcli.explain.lens import logit_lens
    from tfmcli.io import run_arrays

    run, fwd, _ = execute(opts, with_grads=False, validate=lambda cfg: check_indices(cfg, row),
                          keep=lambda run: set())   # the lens reads the streams alone
    cfg = run.cfg
    lazy = hasattr(run.params, "meta")   # streamed from a folder: read once for every stream
    rows = logit_lens(head_params(run.params, cfg) if lazy else run.params, fwd, cfg, row, top)
    length = int(run.inputs.lengths[row])
    tokens = run.token_labels(row)[:length]
    targets = run.target_labels(row)[:length]
    grid = [[[(run.token_text(int(t)), float(p)) for t, p in zip(r.top[i], r.probs[i])]
             for i in range(length)] for r in rows]
    note = ("each cell: the most likely next tokens and their probabilities, after "
            + ("ln_f and " if cfg.norm == "pre" else "") + "the head; green = the target")
    parts = [render.config_panel(describe(cfg, run, row), title="tfm lens"),
             render.lens_table([r.name for r in rows], tokens, targets, grid, width=width(),
                               full=full),
             Text(note, style="dim")]
    payload = {"row": row, "tokens": run.inputs.tokens[row, :length].tolist(),
               "token_text": tokens,
               "layers": [{"name": r.name, "stream": r.stream,
                           "top": [[{"id": int(t), "text": run.token_text(int(t)), "p": float(p)}
                                    for t, p in zip(r.top[i], r.probs[i])]
                                   for i in range(length)]} for r in rows]}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd))


def head_params(params, cfg) -> dict:
    """The final norm's and the head's weights, read once for every stream's lens."""
    names = [n for n in ("ln_f.gamma", "ln_f.beta", "head.W_U", "head.b_U") if n in params]
    if cfg.tied_head:
        names.append("embed.W_E")
    return {name: params[name] for name in names}
