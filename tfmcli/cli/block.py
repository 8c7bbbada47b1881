"""tfm block: one block's residual stream at one position, forward and backward, number by
number."""

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

# central differences run the block twice per entry of x: 32 entries when T d^2 (its cost on
# one row) is at most CHEAP, else 4 (GPT-2 small's block on 512 tokens: 0.12 s a run)
CHEAP, CHECKED, CHECKED_LARGE = 1 << 24, 32, 4
SHAPES = {
    "pre": ("Pre-LN: y = x + MHA(LN1(x)),  z = y + FFN(LN2(y))",
            "the gradient at each sum is the one after it, carried straight through, plus what "
            "comes back through the sublayer and its layer norm"),
    "post": ("Post-LN: y = LN1(x + MHA(x)),  z = LN2(y + FFN(y))",
             "each layer norm's backward comes first; then the gradient at each sum is carried "
             "straight through, plus what comes back through the sublayer"),
    "sandwich": ("Pre-LN, sandwich: y = x + LN1_post(MHA(LN1(x))),  z = y + LN2_post(FFN(LN2(y)))",
                 "the gradient at each sum is the one after it, carried straight through, plus "
                 "what comes back through the sublayer's output norm, the sublayer and its "
                 "input norm"),
    "parallel": ("Pre-LN, parallel: y = x + MHA(LN1(x)),  z = y + FFN(LN2(x))",
                 "nothing but the sum reads y, so its gradient is dz; x feeds the stream and both "
                 "sublayers, so its gradient is dz plus what comes back through each sublayer "
                 "and its layer norm"),
    "shared": ("Pre-LN, parallel, one norm: h = LN1(x),  z = x + MHA(h) + FFN(h)",
               "nothing but the sum reads y, so its gradient is dz; h feeds both sublayers, so "
               "its gradient is the sum of theirs, and x's is dz plus LN1's backward of it"),
}


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def block(
    block: Annotated[int, typer.Option("--block", callback=bounded(0), help="Block to show.")] = 0,
    row: Row = 0,
    position: Position = 0,
    precision: Precision = 4,
    full: WideRows = False,
    opts: Options = None,
):
    """One block's residual stream at one position: each sum, then dz back to dx, path by path.

    Example: tfm block --position 2
    """
    from tfmcli.explain.block import explain
    from tfmcli.explain.cells import agreement
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row, None, block)
        check_range(position, cfg.seq_len, "--position", "positions")

    run, fwd, grads = execute(opts, with_grads=True, validate=validate,
                              keep=lambda run: block_tensors(run.cfg, block),
                              held=lambda run: block_tensors(run.cfg, block))
    cfg = run.cfg
    entries = CHECKED if cfg.seq_len * cfg.d_model ** 2 <= CHEAP else CHECKED_LARGE
    x = explain(run.params, fwd, grads, cfg, block, row, position, entries)
    p = f"blocks.{block}."

    def named(rows):
        return ", ".join(f"{r.name} ({r.model})" for r in rows if r.model is not None)

    def off(rows, tensors, what):   # beside the run's own, over the rows that have one
        own = [r for r in rows if r.model is not None]
        return agreement(fwd, what, np.concatenate([r.value for r in own]),
                         np.concatenate([tensors[p + r.model][row, position] for r in own]),
                         [p + r.model for r in own])

    forward_off = off(x.forward, fwd.acts, named(x.forward))
    backward_off = off(x.backward, grads.acts, named(x.backward))
    dx = x.backward[-1].value
    # the central differences run the block as it is, without the run's interventions
    numeric_check = agreement(fwd, "dx", x.numeric_dx, dx[x.checked],
                              [name for name in fwd.acts if name.startswith(p)], 1e-6)
    numeric_off = numeric_check.off
    token = run.token_labels(row)[position]
    kind = ("sandwich" if cfg.sandwich_norm else "shared" if cfg.shared_norm
            else "parallel" if cfg.parallel_residual else cfg.norm)
    shape, backward_shape = SHAPES[kind]

    def table(rows):   # every column, wrapped in blocks, up to 32 (or with --full)
        return render.tensor_table(np.vstack([r.value for r in rows]),
                                   row_labels=[r.name for r in rows], precision=precision,
                                   width=width(), full=full or cfg.d_model <= WHOLE)

    def legend(rows):   # each row's formula and its length (L2 norm), in one notation
        from tfmcli.render.numbers import notation

        label = max(len(r.name) for r in rows)
        lengths = [float(np.linalg.norm(r.value)) for r in rows]
        style = notation(lengths)
        written = [render.fmt(n, precision, style, sign=False) for n in lengths]
        wide = max(len(w) for w in written)   # e-123 is wider than e-06
        return Text("\n".join(f"{r.name:>{label}}  |{w:>{wide}}|  {r.formula}"
                              for r, w in zip(rows, written)), style="dim")


    def parts():
        views = [
            render.config_panel(describe(cfg, run, row), title=f"tfm block: block {block}, "
                                                               f"batch row {row}, position "
                                                               f"{position}"),
            Text(f"forward: the residual stream of block {block} at position {position} "
                 f"(token {token})", style="bold"),
            Text(shape),
            table(x.forward),
            legend(x.forward),
            Text(forward_off.sentence("differ from the model's own"), style="dim"),
            Text("backward: " + backward_shape, style="bold"),
            table(x.backward),
            legend(x.backward),
            Text(backward_off.sentence("differ from the backward pass's own") + "; "
                 + numeric_check.sentence("from central differences of sum(dz * block(x)) over "
                                          "the row's positions"), style="dim"),
            Text("|...|: each row's length; the paths come from tfm ffn, tfm attn --backward "
                 "and tfm ln, which lay them out", style="dim")]
        if cfg.pe == "rope":
            views.append(Text("RoPE: dq and dk here are the gradients of q and k before their "
                              "turn (tfm attn --backward turns them back)", style="dim"))
        if not dx.any():
            views.append(Text(f"dx is 0 here: position {position} of row {row} reaches "
                              f"nothing the loss counts (padding)", style="dim"))
        return views

    def rows_json(rows):
        return [{"name": r.name, "formula": r.formula, "value": r.value.tolist(),
                 "model": None if r.model is None else p + r.model} for r in rows]

    payload = {"block": block, "row": row, "position": position, "token": token,
               "norm": cfg.norm, "forward": rows_json(x.forward),
               "backward": rows_json(x.backward), "forward_model_diff": forward_off.off,
               "backward_model_diff": backward_off.off, "checked": x.checked.tolist(),
               "dx_numeric_diff": numeric_off}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
