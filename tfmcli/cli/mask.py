"""tfm mask: the causal grid, the padding rows and each row's combined mask."""

import math
from typing import Annotated, Optional

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import emit, width
from tfmcli.cli.options import OUTPUT_OPTIONS, Options, bounded, parse_lengths, with_options

MAX_MAPS = 8    # combined masks drawn (--json has all)
MAX_GRID = 40   # beyond this, a mask is drawn one character per group of keys
MAX_LINES = 40  # and a square mask groups its queries too, so that it stays about square


def mask_view(grid, title, additive_form, row_labels, col_labels, square=True):
    """A mask as a grid of symbols when it fits the terminal; when it is big or too wide, one
    character per group of keys that fits (and, for a square mask, one line per group of
    queries)."""
    if max(grid.shape) <= MAX_GRID and width() >= render.mask_grid_width(
            grid.shape, additive=additive_form, row_labels=row_labels, col_labels=col_labels):
        return render.mask_grid(grid, title=title, additive=additive_form,
                                row_labels=row_labels, col_labels=col_labels)
    row_group = math.ceil(grid.shape[0] / MAX_LINES) if square else 1
    return render.mask_overview(grid, title=title, width=width(), row_labels=row_labels,
                                col_labels=col_labels, row_group=row_group)


@app.command()
@with_options([spec for spec in OUTPUT_OPTIONS])
def mask(
    length: Annotated[int, typer.Option(
        "--len", "-T", callback=bounded(1, 1024), help="Sequence length N (1..1024).")] = 7,
    lengths: Annotated[Optional[str], typer.Option(
        "--lengths", metavar="4,2,6", help="Valid length of each batch row (1..N).")] = None,
    causal: Annotated[bool, typer.Option(
        "--causal/--no-causal", help="Include the look-ahead (causal) mask.")] = True,
    window: Annotated[Optional[int], typer.Option(
        "--sliding-window", metavar="W", callback=bounded(1),
        help="Each query sees only the last W keys, itself included (Mistral's sliding window; "
             "needs --causal) (>= 1).")] = None,
    additive_form: Annotated[bool, typer.Option(
        "--additive", help="Show the 0 / -inf form added to the scores.")] = False,
    opts: Options = None,
):
    """The causal grid, the padding rows and each row's combined mask (True = may attend).

    Example: tfm mask --len 7 --lengths 4,2,6
    """
    from tfmcli.engine.masks import (
        additive,
        causal_mask,
        combined_mask,
        padding_mask,
        sliding_window_mask,
    )
    from tfmcli.io import jsonable

    if window is not None and not causal:
        raise typer.BadParameter(
            "a sliding window hides the keys far behind each query, so the "
            "mask must be causal; drop --no-causal",
            param_hint="'--sliding-window'",
        )

    rows = parse_lengths(lengths) or (length,)
    bad = [n for n in rows if not 1 <= n <= length]
    if bad:
        raise typer.BadParameter(
            f"{bad[0]} is outside 1..{length} (--len)", param_hint="'--lengths'"
        )
    causal_grid = causal_mask(length) if causal else np.ones((length, length), dtype=bool)
    pad = padding_mask(rows, length)
    combined = combined_mask(rows, length, causal, window)
    queries, keys = [f"q{t}" for t in range(length)], [f"k{t}" for t in range(length)]
    if window is None:
        first = mask_view(causal_grid, "causal (look-ahead)" if causal else "no causal mask",
                          additive_form, queries, keys)
    else:   # the causal grid narrowed to the last W keys
        window_grid = sliding_window_mask(length, window)
        first = mask_view(window_grid, f"causal, sliding window {window}", additive_form,
                          queries, keys)
    grids = [first,
             mask_view(pad, f"padding, lengths {list(rows)}", additive_form,
                       [f"row {b}" for b in range(len(rows))], keys, square=False)]
    padded = [b for b, n in enumerate(rows) if n < length]   # a full row's is the first grid
    grids += [mask_view(combined[b], f"combined, row {b} (length {rows[b]})", additive_form,
                        queries, keys) for b in padded[:MAX_MAPS]]
    if len(padded) > MAX_MAPS:
        grids.append(Text(f"showing the combined masks of {MAX_MAPS} of {len(padded)} padded "
                          f"rows (--json has all)", style="dim"))
    full = [str(b) for b, n in enumerate(rows) if n == length]
    grid = "sliding-window" if window else "causal" if causal else "all-True"
    notes = [Text(f"combined, row{'s' * (len(full) > 1)} {', '.join(full)} (length {length}, no "
                  f"padding): the {grid} grid itself", style="dim")] if full else []
    parts = [render.mask_legend(additive_form), render.grids_side_by_side(*grids), *notes]
    payload = {
        "causal": causal_grid.tolist(),
        "padding": pad.tolist(),
        "combined": combined.tolist(),
    }
    if additive_form:
        payload["additive"] = jsonable(additive(combined))
    arrays = {"causal": causal_grid, "padding": pad, "combined": combined}
    if window is not None:
        payload["sliding_window"] = window_grid.tolist()
        arrays["sliding_window"] = window_grid
    emit(opts, parts, payload, arrays)
