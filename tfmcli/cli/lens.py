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
    stream: Annotated[bool, typer.Option(
        "--stream", help="Read --load DIR's weights a block at a time, holding one block.")
    ] = False,
    opts: Options = None,
):
    """The logit lens: after each block, the next tokens the model would predict there.

    Example: tfm lens --tokens 3,1,4,1,5 -L 3
    """
    from tfmcli.explain.lens import logit_lens
    from tfmcli.io import run_arrays

    if stream:
        run, fwd = streamed(opts, row)
    else:
        run, fwd, _ = execute(opts, with_grads=False,
                              validate=lambda cfg: check_indices(cfg, row),
                              also=", read a LLaMA-family folder a block at a time (--stream)")
    cfg = run.cfg
    rows = logit_lens(head_params(run.params, cfg) if stream else run.params, fwd, cfg, row,
                      top)
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
    # streamed, the weights stay in their files: the run's inputs and streams only
    emit(opts, parts, payload, run_arrays(cfg, {} if stream else run.params, run.inputs, fwd))


def streamed(opts: Options, row: int):
    """The run with its weights read a block at a time (``sources.Run.lazy_params``) and the
    forward pass keeping each block's input and output only: the numbers of the whole pass,
    bit for bit, holding one block's weights and activations at a time."""
    from tfmcli.cli.common import forward_changed, interventions

    run = opts.run(memory=False)
    check_indices(run.cfg, row)
    if run.lazy_params is None:
        raise typer.BadParameter("it reads a checkpoint folder's weights a block at a time: "
                                 "--load DIR of a LLaMA, Mistral, Qwen2, Qwen3 or StableLM "
                                 "folder (others: not yet)", param_hint="'--stream'")
    run.params = run.lazy_params()
    inputs = run.complete().inputs
    fwd = forward_changed(opts, run.params, inputs, run.cfg, interventions(opts, run),
                          keep=set())
    return run, fwd


def head_params(params, cfg) -> dict:
    """The final norm's and the head's weights, read once for every stream's lens."""
    names = [n for n in ("ln_f.gamma", "ln_f.beta", "head.W_U", "head.b_U") if n in params]
    if cfg.tied_head:
        names.append("embed.W_E")
    return {name: params[name] for name in names}
