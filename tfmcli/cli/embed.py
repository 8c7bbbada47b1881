"""tfm embed: the embedding and the positions at one position, forward and backward, number by
number."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    MAX_ROWS,
    WHOLE,
    Position,
    Precision,
    Row,
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
    WHOLE_RUN_OPTIONS,
    Options,
    check_range,
    with_options,
)
from tfmcli.engine import sizes

# entries checked by central differences, each running the whole model twice: 8, or 1 when a
# forward pass takes over LARGE floating-point operations (GPT-2 small on 32 tokens: 7.9e9)
CHECKED, CHECKED_LARGE, LARGE = 8, 1, 10**9
POSITIONS = {
    "sinusoidal": "PE[t] = the sinusoidal table's row: PE[t, 2i] = sin(t / 10000^(2i/d)), "
                  "PE[t, 2i+1] = cos(t / 10000^(2i/d))",
    "learned": "PE[t] = W_pos[t], a learned row (a parameter)",
    "none": "no positions: x0 = W_E[id]",
    "rope": "RoPE adds nothing here: x0 = W_E[id]; each head's q and k are turned by their "
            "position's angles instead (tfm attn)",
    "alibi": "ALiBi adds nothing here: x0 = W_E[id]; each head adds -m (i - j) to its scores "
             "of query i at key j instead (tfm attn, tfm pe --alibi)",
}


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def embed(
    row: Row = 0,
    position: Position = 0,
    precision: Precision = 4,
    full: Annotated[bool, typer.Option(
        "--full",
        help="Every column and every position of the token (without it, up to 32 columns and 40 "
             "positions).")] = False,
    opts: Options = None,
):
    """One position's embedding, number by number: W_E's row plus the position's; then its gradient.

    Example: tfm embed --position 2
    """
    from tfmcli.explain.embedding import explain
    from tfmcli.explain.loss import input_name as head_input
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row)
        check_range(position, cfg.seq_len, "--position", "positions")

    run, fwd, grads = execute(opts, with_grads=True, validate=validate,
                              whole="checks W_E's row by central differences through the whole "
                                    "model, so it holds every weight")
    cfg = run.cfg
    entries = CHECKED if sizes.flops(cfg)[0] <= LARGE else CHECKED_LARGE
    x = explain(run.params, fwd, grads, cfg, row, position, entries)
    from tfmcli.explain.cells import agreement

    mine, own = [x.scale * x.w_e], [fwd.acts["embed"][row, position]]
    if x.pe is not None:
        mine, own = mine + [x.pe], own + [fwd.acts["pe"][position]]
    forward_check = agreement(fwd, "the model's own lookup (embed)" + (
        " and positions (pe)" if x.pe is not None else ""), np.concatenate(mine),
        np.concatenate(own), ["embed", "pe"])
    # an embedding changed passes no gradient (or a scaled one) back to W_E's row
    dw_e_check = agreement(fwd, f"dW_E[{x.token}]", x.dw_e, grads["embed.W_E"][x.token],
                           ["embed", "pe", "blocks.0.in"])
    forward_off, dw_e_off = forward_check.off, dw_e_check.off
    dw_e_numeric_off = float(np.abs(x.numeric_dw_e - x.dw_e[x.checked]).max())
    dw_pos_off = dw_pos_numeric_off = None
    if x.dw_pos is not None:
        dw_pos_off = float(np.abs(grads["embed.W_pos"][position] - x.dw_pos).max())
        dw_pos_numeric_off = float(np.abs(x.numeric_dw_pos - x.dw_pos[x.checked]).max())
    labels = run.token_labels(row)
    scaled = cfg.embed_scale   # x0 = sqrt(d) W_E[id] (+ PE[t]); the lookup's gradient times it
    text = run.token_text(x.token)
    named = text + ("" if text == str(x.token) else f" (id {x.token})")
    n = len(x.occurrences)

    def table(rows: dict, caption=None, mask=None):   # every column wrapped, up to 32 (or --full)
        return render.tensor_table(np.vstack(list(rows.values())), row_labels=list(rows),
                                   caption=caption, precision=precision, width=width(),
                                   full=full or cfg.d_model <= WHOLE, mask=mask)

    def occurrences_table():
        """dx0 at each position of the token (the first MAX_ROWS without --full), and the sum."""
        shown = x.occurrences if full or n <= MAX_ROWS else x.occurrences[:MAX_ROWS]
        rows = {f"({b},{t})": x.dx0[k] for k, (b, t) in enumerate(shown)}
        left_out = n - len(shown)
        if left_out:   # a row of dim dots, not numbers
            rows[f"… {left_out} more"] = np.zeros(cfg.d_model)
        rows["sum"] = x.dx0.sum(axis=0)
        if scaled:
            rows["x sqrt(d)"] = x.embedding_part
        mask = np.ones((len(rows), cfg.d_model), dtype=bool)
        if left_out:
            mask[-2 - scaled] = False
        return table(rows, f"{left_out} positions left out of the table (--full shows them)"
                     if left_out else None, mask)

    def parts():
        where = f"position {position} of batch row {row} holds the token {named}"
        views = [
            render.config_panel(describe(cfg, run, row),
                                title=f"tfm embed: batch row {row}, position {position}"),
            Text(f"forward: x0 = {'sqrt(d) ' * scaled}W_E[id]"
                 f"{' + PE[t]' if x.pe is not None else ''}, "
                 + ("which ln_embed normalises into the first block's input (tfm ln --layer "
                    "ln_embed); dx0 below is the gradient of x0, before that norm"
                    if cfg.embed_norm else "the first block's input"),
                 style="bold"),
            Text(where),
            Text(POSITIONS[cfg.pe].replace("x0 = W_E", "x0 = sqrt(d) W_E") if scaled
                 else POSITIONS[cfg.pe])]
        if scaled:
            views.append(Text(f"the row is multiplied by sqrt(d) = sqrt({cfg.d_model}) = "
                              f"{x.scale:.6g} (--embed-scale)"
                              + (" before anything is added" if x.pe is not None else "")))
        rows = {f"W_E[{x.token}]": x.w_e}
        if scaled:
            rows[f"sqrt(d) W_E[{x.token}]"] = x.scale * x.w_e
        if x.angle is not None:
            rows["angle"] = x.angle
        if x.pe is not None:
            rows[f"PE[{position}]"] = x.pe
        rows["x0"] = x.x0
        views += [
            table(rows, "angle: t / 10000^(2i/d) for columns 2i and 2i+1"
                  if x.angle is not None else None),
            Text(forward_check.sentence("differ from these" if x.pe is not None
                                        else "differs from it"), style="dim"),
            Text(f"backward: dW_E[{x.token}] sums dx0 over every position that holds the "
                 f"token" + (", times sqrt(d)" if scaled else ""), style="bold"),
            Text(f"the lookup copied row {x.token} to {n} position{'s' * (n > 1)} of the "
                 f"batch, (row,position) " + ", ".join(f"({b},{t})" for b, t in
                                                       x.occurrences[:8])
                 + (", …" if n > 8 else "") + ": each one's dx0 flows back into it (the "
                 "rows below)"),
            occurrences_table()]
        if x.head_part is not None:
            dz = "dlogits" if cfg.logit_softcap is None else "dz"
            views += [
                Text(f"tied: the head's W_U is W_E^T, so row {x.token} is also the head's "
                     f"column {x.token}: it adds sum over b, t of {dz}[b, t, {x.token}] "
                     f"h[b, t] ({cfg.batch * cfg.seq_len} positions; h = {head_input(cfg)}"
                     + (", dz = dlogits x (1 - (logits / C)^2), through the cap)"
                        if cfg.logit_softcap is not None else ")")),
                table({"lookup": x.embedding_part, "head": x.head_part,
                       f"dW_E[{x.token}]": x.dw_e})]
        checked = ("every entry" if x.checked.size == cfg.d_model else
                   f"the {x.checked.size} entries with the largest gradient")
        views.append(Text(
            dw_e_check.sentence("differs from the backward pass's") + ", and from central "
            f"differences of the loss (the whole model again, in float64; {checked}) by "
            f"{dw_e_numeric_off:.1e}", style="dim"))
        if x.dw_pos is not None:
            views += [
                Text(f"dW_pos[{position}] sums dx0 at position {position} over the batch "
                     f"({cfg.batch} row{'s' * (cfg.batch > 1)})", style="bold"),
                table({**{f"({b},{position})": x.dx0_at_t[b] for b in range(cfg.batch)},
                       "sum": x.dw_pos}),
                Text(f"dW_pos[{position}] differs from the backward pass's by "
                     f"{dw_pos_off:.1e}, and from central differences of the loss by "
                     f"{dw_pos_numeric_off:.1e}", style="dim")]
        elif cfg.pe == "sinusoidal":
            views.append(Text("the sinusoidal table is fixed, not learned: nothing to update "
                              "there", style="dim"))
        if not x.dw_e.any():
            views.append(Text(f"dW_E[{x.token}] is 0: no position that holds {named} adds "
                              f"to the loss", style="dim"))
        return views

    payload = {"row": row, "position": position, "token": labels[position], "id": x.token,
               "w_e": x.w_e.tolist(), "pe": None if x.pe is None else x.pe.tolist(),
               "scale": x.scale, "x0": x.x0.tolist(), "forward_model_diff": forward_off,
               "occurrences": [list(o) for o in x.occurrences], "dx0": x.dx0.tolist(),
               "embedding_part": x.embedding_part.tolist(),
               "head_part": None if x.head_part is None else x.head_part.tolist(),
               "dW_E": x.dw_e.tolist(), "dW_E_model_diff": dw_e_off,
               "dW_E_numeric_diff": dw_e_numeric_off, "checked": x.checked.tolist(),
               "dW_pos": None if x.dw_pos is None else x.dw_pos.tolist(),
               "dW_pos_model_diff": dw_pos_off, "dW_pos_numeric_diff": dw_pos_numeric_off}
    emit(opts, parts, payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
