"""tfm kv: decode one token at a time with a KV cache, checked against the full forward."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (Full, Precision, Row, check_indices, describe, emit, execute,
                               position_labels, rows_limit, width)
from tfmcli.cli.options import MODEL_OPTIONS, OUTPUT_OPTIONS, RUN_OPTIONS, Options, bounded, with_options
from tfmcli.cli.shapes import human


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def kv(
    row: Row = 0,
    block: Annotated[int, typer.Option("--block", callback=bounded(0), help="Block whose attention rows are drawn.")] = 0,
    head: Annotated[int, typer.Option("--head", callback=bounded(0), help="Head whose attention rows are drawn.")] = 0,
    precision: Precision = 2,
    full: Full = False,
    opts: Options = None,
):
    """Decode batch row --row one token at a time with a KV cache; each step against the full pass.

    Example: tfm kv --tokens 3,1,4,1,5,9,2,6 -L 2
    """
    from tfmcli.kv import decode
    from tfmcli.masks import causal_mask

    def validate(cfg):
        check_indices(cfg, row, head, block)
        if not cfg.causal:
            raise typer.BadParameter("a KV cache decodes left to right, so the model must be "
                                     "causal; drop --no-causal", param_hint="'--causal'")

    run, fwd, _ = execute(opts, with_grads=False, validate=validate)
    cfg = run.cfg
    length = int(run.inputs.lengths[row])
    steps = decode(run.params, run.inputs.tokens[row, :length], cfg)
    diffs = [float(np.abs(s.logits - fwd.acts["logits"][row, s.step]).max()) for s in steps]
    cached, uncached = sum(s.flops_cached for s in steps), sum(s.flops_full for s in steps)
    labels = run.token_labels(row)

    table = render.record_table(
        ["step", "token", "K, V cache", "max |Δ logits|", "FLOPs cached", "no cache"],
        [[str(s.step), labels[s.step], str(s.cache_shape), f"{d:.1e}", f"{s.flops_cached:,}",
          f"{s.flops_full:,}"] for s, d in zip(steps, diffs)],
        title=f"decoding batch row {row}, one token per step", max_rows=rows_limit(full), left=2)
    table.caption = "K, V cache: each block's cached keys and values, (H, step + 1, d_head)"
    rows = np.zeros((length, length))
    for s in steps:
        rows[s.step, :s.step + 1] = s.attention[(block, head)]
    attention = render.heatmap(
        rows, title=f"block {block} head {head}: the new query's attention, one row per step",
        row_labels=position_labels(run, row, "q")[:length],
        col_labels=position_labels(run, row, "k")[:length], mask=causal_mask(length),
        width=width(), vmin=0.0, vmax=1.0, precision=precision)
    worst = max(diffs)
    summary = Text(f"every step equals the full causal forward: max |Δ logits| {worst:.1e}; "
                   f"matmul FLOPs for {render.counted(length, 'token')}: {human(cached)} with "
                   f"the cache, {human(uncached)} recomputing each prefix "
                   f"({uncached / cached:.1f}x)",
                   style="bold")
    payload = {"row": row, "tokens": [s.token for s in steps],
               "steps": [{"step": s.step, "token": s.token, "cache_len": s.step + 1,
                          "cache_shape": list(s.cache_shape), "max_abs_diff": d,
                          "flops_cached": s.flops_cached, "flops_full": s.flops_full,
                          "attention": s.attention[(block, head)].tolist()}
                         for s, d in zip(steps, diffs)],
               "flops": {"with_cache": cached, "without_cache": uncached},
               "max_abs_diff": worst}
    emit(opts, [render.config_panel(describe(cfg, run, row), title="tfm kv"), table, attention,
                summary], payload)
