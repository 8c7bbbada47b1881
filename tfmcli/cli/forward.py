"""tfm forward: config, the shape trace of every activation, attention maps, loss."""

import json
from collections import ChainMap
from typing import Annotated, Optional

import typer
from rich.cells import cell_len
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Precision,
    Row,
    Show,
    check_indices,
    check_show,
    describe,
    emit,
    execute,
    height,
    position_labels,
    rows_limit,
    show_tensors,
    width,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    with_options,
)
from tfmcli.engine import sizes


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def forward(
    show: Show = None,
    row: Row = 0,
    head: Annotated[Optional[int], typer.Option(
        "--head", callback=bounded(0), help="Only this head's heatmap (and --show slice).")] = None,
    block: Annotated[Optional[int], typer.Option(
        "--block", callback=bounded(0), help="Only this block's heatmaps.")] = None,
    precision: Precision = 4,
    full: Annotated[bool, typer.Option(
        "--full", help="Every attention map and trace row, none elided.")] = False,
    loss: Annotated[bool, typer.Option(
        "--loss",
        help="The loss term by term: each scored position's target, its probability and -log p, "
             "and their mean.")] = False,
    opts: Options = None,
):
    """Run the forward pass: config, shape trace of every activation, attention maps, loss.

    Example: tfm forward --seed 1000 --show blocks.0.attn.pattern --row 1
    """
    from tfmcli.engine.model import block_masks
    from tfmcli.explain.summary import activation_stats
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row, head, block)
        check_show(cfg, show)

    def layout(run):   # which heads' maps the view draws, and whether with their numbers
        cfg = run.cfg
        pairs = [(b, h) for b in (range(cfg.layers) if block is None else [block])
                 for h in (range(cfg.heads) if head is None else [head])]
        labels = position_labels(run, row, "q")
        return (pairs, *render.maps_layout(pairs, cfg.seq_len, width(), full, height(),
                                           max(map(cell_len, labels))))

    def keep(run):   # streamed: what the view reads whole (the rest it reads summarised)
        drawn = [] if opts.json else layout(run)[1]
        return check_show(run.cfg, show) | {f"blocks.{b}.attn.pattern" for b, _ in drawn}

    run, fwd, _ = execute(opts, with_grads=False, validate=validate, keep=keep)
    cfg, params, inputs = run.cfg, run.params, run.inputs
    shown, shown_json = show_tensors(ChainMap(fwd.acts, params), show, precision, row, head or 0,
                                     run)
    terms = loss_terms(run, fwd) if loss else None

    def parts():   # drawn only without --json
        pairs, picked, values = layout(run)
        labels = position_labels(run, row, "q")
        patterns = {(b, h): fwd.acts[f"blocks.{b}.attn.pattern"][row, h] for b, h in picked}
        masks = block_masks(cfg, inputs.lengths, cfg.seq_len, row)
        maps = render.attention_maps(patterns, masks, row, width(), total=len(pairs),
                                     row_labels=labels, col_labels=position_labels(run, row, "k"),
                                     values=values)
        return [render.config_panel(describe(cfg, run, row), title="tfm forward"),
                render.shape_trace(fwd.acts, precision=precision, max_rows=rows_limit(full)),
                *maps, *shown,
                *([] if terms is None else terms_view(terms, run, fwd, precision, full)),
                Text(f"loss = {fwd.loss:.{precision + 2}f}  (mean cross-entropy over "
                     f"{render.counted(fwd.scored, 'position')})", style="bold")]

    payload = lambda: {   # noqa: E731  (computed only for --json)
        "config": json.loads(cfg.to_json()), "parameters": sizes.param_count(cfg),
        "loss": fwd.loss,
        "activations": [{"name": name, **activation_stats(name, fwd.acts)} for name in fwd.acts],
        "show": shown_json, **({} if terms is None else {"loss_terms": terms})}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd))


def loss_terms(run, fwd) -> list[dict]:
    """Each scored position of the batch, in order: its row, position, token and target, the
    target's probability and -log p (``ops.cross_entropy_terms``: their mean is the loss)."""
    from tfmcli.engine.ops import cross_entropy_terms

    cache = fwd.caches["loss"]
    nll = cross_entropy_terms(fwd.acts["logits"], cache.targets, cache.valid)
    tokens, probs = run.inputs.tokens, fwd.acts["probs"]
    return [{"row": int(b), "position": int(t), "token": int(tokens[b, t]),
             "target": int(cache.targets[b, t]), "p": float(probs[b, t, cache.targets[b, t]]),
             "nll": float(nll[b, t])}
            for b, t in zip(*cache.valid.nonzero())]


def terms_view(terms, run, fwd, precision, full):
    """The terms as a table (tokens by their text), and the sum that makes the loss."""
    import math

    from tfmcli.render.numbers import fmt, notation

    ps, nlls = [x["p"] for x in terms], [x["nll"] for x in terms]
    p_style, nll_style = notation(ps), notation(nlls)
    table = render.record_table(
        ["row", "pos", "token", "target", "p(target)", "-log p"],
        [[str(x["row"]), str(x["position"]), run.token_text(x["token"]),
          run.token_text(x["target"]), fmt(x["p"], precision, p_style, sign=False),
          fmt(x["nll"], precision, nll_style, sign=False)] for x in terms],
        title="the loss term by term", max_rows=rows_limit(full), left=0)
    for column in table.columns[2:4]:   # words
        column.justify = "left"
    note = ("each scored position: the target (the next token), its probability after the "
            "softmax, and -log p, the position's cross-entropy")
    table.caption = note if table.caption is None else f"{note}\n{table.caption}"
    total = math.fsum(nlls)
    return [table, Text(f"the {render.counted(len(terms), 'term')} sum to "
                        f"{total:.{precision + 2}f}; / {fwd.scored} = "
                        f"{total / fwd.scored:.{precision + 2}f}, the loss", style="bold")]
