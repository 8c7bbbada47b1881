"""tfm forward: config, the shape trace of every activation, attention maps, loss."""

import json
from typing import Annotated, Optional

import typer
from rich.cells import cell_len
from rich.text import Text

from tfmcli import config as sizes
from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (Precision, Row, Show, check_indices, check_show, describe, emit,
                               execute, position_labels, rows_limit, show_tensors,
                               height, width)
from tfmcli.cli.options import MODEL_OPTIONS, OUTPUT_OPTIONS, RUN_OPTIONS, Options, bounded, with_options


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def forward(
    show: Show = None,
    row: Row = 0,
    head: Annotated[Optional[int], typer.Option("--head", callback=bounded(0), help="Only this head's heatmap (and --show slice).")] = None,
    block: Annotated[Optional[int], typer.Option("--block", callback=bounded(0), help="Only this block's heatmaps.")] = None,
    precision: Precision = 4,
    full: Annotated[bool, typer.Option("--full", help="Every attention map and trace row, none elided.")] = False,
    opts: Options = None,
):
    """Run the forward pass: config, shape trace of every activation, attention maps, loss.

    Example: tfm forward --seed 1000 --show blocks.0.attn.pattern --row 1
    """
    from tfmcli.io import run_arrays
    from tfmcli.masks import combined_mask
    from tfmcli.summary import stats

    def validate(cfg):
        check_indices(cfg, row, head, block)
        check_show(cfg, show)

    run, fwd, _ = execute(opts, with_grads=False, validate=validate)
    cfg, params, inputs = run.cfg, run.params, run.inputs
    shown, shown_json = show_tensors({**fwd.acts, **params}, show, precision, row, head or 0, run)
    pairs = [(b, h) for b in (range(cfg.layers) if block is None else [block])
             for h in (range(cfg.heads) if head is None else [head])]

    def parts():   # drawn only without --json
        labels = position_labels(run, row, "q")
        picked = render.maps_that_fit(pairs, cfg.seq_len, width(), full, height(),
                                      max(map(cell_len, labels)))
        patterns = {(b, h): fwd.acts[f"blocks.{b}.attn.pattern"][row, h] for b, h in picked}
        mask = combined_mask(inputs.lengths, cfg.seq_len, cfg.causal)[row]
        maps = render.attention_maps(patterns, mask, row, width(), total=len(pairs),
                                     row_labels=labels, col_labels=position_labels(run, row, "k"))
        return [render.config_panel(describe(cfg, run, row), title="tfm forward"),
                render.shape_trace(fwd.acts, precision=precision, max_rows=rows_limit(full)),
                *maps, *shown,
                Text(f"loss = {fwd.loss:.{precision + 2}f}  (mean cross-entropy over "
                     f"{render.counted(fwd.scored, 'position')})", style="bold")]

    payload = lambda: {   # noqa: E731  (computed only for --json)
        "config": json.loads(cfg.to_json()), "parameters": sizes.param_count(cfg),
        "loss": fwd.loss,
        "activations": [{"name": name, **stats(value)} for name, value in fwd.acts.items()],
        "show": shown_json}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd))
