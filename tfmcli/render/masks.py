"""Attention masks as grids of symbols: which key each query may attend to."""

from __future__ import annotations

import numpy as np
from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

ATTEND, HIDDEN = "●", "·"
ATTEND_ADDITIVE, HIDDEN_ADDITIVE = "0", "-inf"
ATTEND_STYLE, HIDDEN_STYLE = "green", "dim"


def mask_grid(mask, *, title: str | None = None, additive: bool = False, row_labels=None,
              col_labels=None) -> Table:
    """A boolean mask as a grid: ``●`` may attend, ``·`` hidden (or ``0`` / ``-inf``).

    Parameters
    ----------
    mask : (R, C) bool array_like
        True = may attend; rows are queries (or batch rows, for a padding mask), columns keys.
    title : str, optional
    additive : bool
        Show the 0 / -inf form that is added to the scores instead of the symbols.
    row_labels, col_labels : sequence of str, optional
        Default to the indices.

    Returns
    -------
    rich.table.Table
    """
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask_grid needs a 2-D mask, got shape {mask.shape}; slice it first")
    rows, cols = mask.shape
    row_labels = [str(i) for i in range(rows)] if row_labels is None else list(row_labels)
    col_labels = [str(j) for j in range(cols)] if col_labels is None else list(col_labels)
    attend, hidden = (ATTEND_ADDITIVE, HIDDEN_ADDITIVE) if additive else (ATTEND, HIDDEN)

    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0),
                  header_style="dim", min_width=cell_len(title) if title else None)
    table.add_column("", style="dim", justify="right")
    for label in col_labels:
        table.add_column(str(label), justify="right")
    for label, row in zip(row_labels, mask.astype(bool)):
        cells = [Text(attend, style=ATTEND_STYLE) if on else Text(hidden, style=HIDDEN_STYLE)
                 for on in row]
        table.add_row(str(label), *cells)
    return table


def mask_legend(additive: bool = False) -> Text:
    """One line saying which symbol means "may attend" and which means "hidden".

    Parameters
    ----------
    additive : bool
        Explain the 0 / -inf form instead of ``●`` / ``·``.

    Returns
    -------
    rich.text.Text
    """
    if additive:
        return Text.assemble((ATTEND_ADDITIVE, ATTEND_STYLE), " may attend (added to the score)   ",
                             (HIDDEN_ADDITIVE, HIDDEN_STYLE), " hidden (softmax weight 0)")
    return Text.assemble((ATTEND, ATTEND_STYLE), " may attend   ", (HIDDEN, HIDDEN_STYLE),
                         " hidden")
