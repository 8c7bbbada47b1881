"""Tables of numbers: one tensor, the activations of a forward pass, the gradients, the config."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import numpy as np
from rich import box
from rich.cells import cell_len
from rich.columns import Columns
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tfmcli.explain.summary import Summary, activation_stats, l2_norm, max_abs, mean
from tfmcli.render.numbers import ZERO_TO_PRECISION, fmt, negligible, notation
from tfmcli.render.text import Printable

ELLIPSIS = "…"
MISSING = "—"


class _Table(Printable, Table):
    """A table whose caption wraps at the screen's width, not at the table's: under a narrow
    table a footnote ("showing 4 of 40 rows; --full shows all") stays on one line; ``str()``
    is the table in plain text. Where the spaces between its columns leave no room for a
    column, it is drawn at its narrowest, a character a column (rich would share the title's
    width among columns of width 0 and assert)."""

    def __rich_console__(self, console, options):
        if options.max_width <= self._extra_width:
            options = options.update_width(self._extra_width + len(self.columns))
        caption, self.caption = self.caption, None
        try:
            yield from super().__rich_console__(console, options)
        finally:
            self.caption = caption
        if caption:
            yield Text(caption, style=self.caption_style or "")   # left, and not padded


def _table(title=None, caption=None) -> Table:
    """The house table: a rule under the header, one space between columns, no frame.

    One space is enough because every number starts with its sign (or a space, for 0), and it
    lets a gradient table with scientific numbers fit in 80 columns. When a table is still too
    wide, name columns fold onto a second line first; a number that must be shortened ends in
    a visible "…" (``overflow="ellipsis"``), never silently. A table is at least as wide as
    its title, so that the title stays on one line above a narrow table, and its caption
    wraps at the screen's width.
    """
    return _Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False,
                 padding=(0, 0), header_style="dim", caption_style="dim italic",
                 caption_justify="left", min_width=cell_len(title) if title else None)


def _number(value: float, precision: int, style: str | None = None, sign: bool = True) -> Text:
    """A formatted number: negative red, -inf dim, nan and +inf yellow (all readable uncoloured)."""
    text = fmt(value, precision, style, sign)
    if text == "-inf":
        colour = "dim"
    elif text in ("nan", "+inf"):
        colour = "yellow"
    elif text.startswith("-"):
        colour = "red"
    else:
        colour = ""
    return Text(text, style=colour)


def _kept(n: int, limit: int, full: bool) -> list[int | None]:
    """Indices to show, with None where the middle was elided: first half, ``None``, last half."""
    if full or n <= limit:
        return list(range(n))
    head = (limit + 1) // 2
    return list(range(head)) + [None] + list(range(n - (limit - head), n))


def _column_width(grid, rows, j, label, precision, style) -> int:
    """The widest number of column ``j`` over ``rows``, or the longest word of its label
    (``style(i, j)``: the notation of each cell).

    Labels wrap at their spaces, so ``"sin λ6.28"`` needs only as much room as ``"λ6.28"``.
    """
    numbers = [len(fmt(grid[i, j], precision, style(i, j))) for i in rows]
    return max(numbers + [cell_len(word) for word in label.split()] + [1])


def _fitting_cols(grid, rows, row_labels, col_labels, max_cols, width, precision, style) -> int:
    """The largest column budget, at most ``max_cols`` (and at least 2), that fits ``width``."""
    label_width = max([cell_len(row_labels[i]) for i in rows] + [1])
    for budget in range(max_cols, 2, -1):
        kept = _kept(grid.shape[1], budget, False)
        widths = [1 if j is None else
                  _column_width(grid, rows, j, col_labels[j], precision, style) for j in kept]
        if label_width + sum(w + 1 for w in widths) <= width:  # + 1: the space before each
            return budget
    return min(max_cols, 2)


def _column_blocks(cols: list, widths: dict, label_width: int, width: int) -> list[list]:
    """``cols`` cut into runs that each fit ``width`` beside the row labels (at least one
    column per run): a table too wide for the terminal wraps in blocks, like NumPy's, as
    even as they fit (six columns as 3 + 3, not 5 and a lone 1)."""
    def need(block):   # + 1: the space before each column
        return label_width + sum(widths.get(j, 1) + 1 for j in block)

    blocks, current = [], []
    for j in cols:
        if current and need(current + [j]) > width:
            blocks.append(current)
            current = []
        current.append(j)
    blocks.append(current)
    size = -(-len(cols) // len(blocks))   # the fewest columns a run needs, spread evenly
    even = [cols[i:i + size] for i in range(0, len(cols), size)]
    if len(even) == len(blocks) and all(need(block) <= width for block in even):
        return even
    return blocks


def _elision_note(kept_rows: list, kept_cols: list) -> str:
    """E.g. "showing 12 of 100 rows, 8 of 100 columns"; empty when nothing was elided."""
    parts = []
    for kept, what in ((kept_rows, "rows"), (kept_cols, "columns")):
        if None in kept:
            parts.append(f"{len(kept) - 1} of {kept[-1] + 1} {what}")
    return "showing " + ", ".join(parts) if parts else ""


def _shape(array) -> str:
    shape = array.shape if isinstance(array, Summary) else np.shape(array)
    return str(tuple(int(n) for n in shape))


def tensor_table(
    array,
    *,
    title: str | None = None,
    precision: int = 4,
    full: bool = False,
    max_rows: int = 12,
    max_cols: int = 8,
    row_labels=None,
    col_labels=None,
    caption: str | None = None,
    width: int | None = None,
    mask=None,
    notation_by: str = "column",
    notations=None,
) -> Table:
    """A 0-, 1- or 2-D array as a table of right-justified numbers, elided like NumPy.

    Parameters
    ----------
    array : (), (C,) or (R, C) array_like
        A 1-D array is shown as one row. Slice bigger arrays first.
    title, caption : str, optional
    precision : int
        Digits after the decimal point (see :func:`fmt`).
    full : bool
        Show every row and column, however many.
    max_rows, max_cols : int
        Beyond these, only the first and last halves are shown, with a ``…`` row/column between.
        At the default precision 8 columns fit in 80 terminal columns; scientific numbers are
        wider, so pass a smaller ``max_cols`` for a narrow terminal.
    row_labels, col_labels : sequence of str, optional
        Default to the indices. A 1-D array has no row label unless given one.
    width : int, optional
        Terminal columns available: unless ``full``, show fewer than ``max_cols`` columns when
        that many would not fit (scientific numbers and long labels are wide). Without it, or
        with ``full``, a table too wide for the terminal shows shortened cells ending in ``…``.
    mask : bool array of the same shape, optional
        False marks a cell hidden by an attention mask: it shows a dim ``·``, never a number,
        so a hidden probability cannot be mistaken for a computed 0.
    notation_by : "column" or "row"
        One notation (fixed or scientific) per column, or per row for a table whose rows are
        quantities (``tfm ffn``'s pre, relu'(pre), dpre): a row of 0s and 1s is then written
        0 and 1.
    notations : mapping of row label to notation, optional
        With ``notation_by="row"``, the notation of these rows, decided elsewhere (the same
        quantity over several tables, as ``tfm adam``'s steps).

    Returns
    -------
    rich.table.Table

    Raises
    ------
    ValueError
        If the array has more than 2 dimensions.
    """
    array = np.asarray(array)
    if array.ndim > 2:
        raise ValueError(f"tensor_table shows at most 2-D arrays, got shape {array.shape}; "
                         "slice it first")
    has_row_labels = array.ndim == 2 or row_labels is not None
    grid = np.atleast_2d(array)
    rows, cols = grid.shape
    row_labels = [str(label) for label in (range(rows) if row_labels is None else row_labels)]
    col_labels = [str(label) for label in (range(cols) if col_labels is None else col_labels)]
    if len(row_labels) != rows or len(col_labels) != cols:
        raise ValueError(f"{len(row_labels)} row labels and {len(col_labels)} column labels "
                         f"for an array of shape {array.shape}")

    shown_rows = _kept(rows, max_rows, full)
    data_rows = [i for i in shown_rows if i is not None]
    hidden = np.zeros(grid.shape, dtype=bool) if mask is None else ~np.atleast_2d(mask)
    style = _notations(grid, hidden, notation_by, row_labels, notations or {})
    if width is not None and not full:
        max_cols = _fitting_cols(grid, data_rows, row_labels, col_labels, max_cols, width,
                                 precision, style)
    shown_cols = _kept(cols, max_cols, full)
    note = _elision_note(shown_rows, shown_cols)
    if note:
        caption = note if caption is None else f"{caption}\n{note}"
    # Fixed widths: rich then never narrows a number to fit a label.
    widths = {j: _column_width(grid, data_rows, j, col_labels[j], precision, style)
              for j in shown_cols if j is not None}

    def cell(i, j):
        if i is None or j is None:
            return Text(ELLIPSIS, style="dim")
        if hidden[i, j]:
            return Text("·", style="dim")
        return _number(grid[i, j], precision, style(i, j))

    def block_table(block, block_title, block_caption):
        table = _table(block_title, block_caption)
        table.show_header = array.ndim > 0
        if has_row_labels:
            table.add_column("", style="dim", justify="right")
        for j in block:
            label = ELLIPSIS if j is None else col_labels[j]
            table.add_column(label, justify="right", width=widths.get(j, 1), overflow="ellipsis")
        for i in shown_rows:
            label = ELLIPSIS if i is None else row_labels[i]
            table.add_row(*([label] if has_row_labels else []), *[cell(i, j) for j in block])
        return table

    blocks = [shown_cols]
    if full and width is not None:
        label_width = (max([cell_len(row_labels[i]) for i in data_rows] + [0])
                       if has_row_labels else 0)
        blocks = _column_blocks(shown_cols, widths, label_width, width)
    if len(blocks) == 1:
        return block_table(shown_cols, title, caption)
    tables = []
    for k, block in enumerate(blocks):
        part = f"columns {col_labels[block[0]]}..{col_labels[block[-1]]} of {cols}"
        tables.append(block_table(block, f"{title}, {part}" if title and k == 0 else part,
                                  caption if k == len(blocks) - 1 else None))
    return Group(*tables)


def _notations(grid, hidden, by: str, row_labels, given: dict):
    """``style(i, j)``: the notation of each cell, one per column, or per row (given, or
    picked from the row, a row of 0s and 1s as an indicator)."""
    if by == "row":
        rows = [given.get(label) or notation(grid[i][~hidden[i]], indicator=True)
                for i, label in enumerate(row_labels)]
        return lambda i, j: rows[i]
    cols = [notation(grid[:, j][~hidden[:, j]]) for j in range(grid.shape[1])]
    return lambda i, j: cols[j]


def row_notations(tables) -> dict:
    """One notation per row label over several ``{label: values}`` tables: the same quantity
    written alike in each (``tfm adam``'s m at steps 1, 2 and 3)."""
    values = {}
    for rows in tables:
        for label, row in rows.items():
            values.setdefault(label, []).append(np.asarray(row, dtype=np.float64).reshape(-1))
    return {label: notation(np.concatenate(rows), indicator=True)
            for label, rows in values.items()}


ZERO_NOTE = f"{ZERO_TO_PRECISION}: zero to working precision (rounding noise)"


def _mean_cell(mean: float, scale: float, dtype) -> float | str:
    """The mean, or ``≈0`` when it is rounding noise next to entries of size ``scale``."""
    eps = float(np.finfo(dtype).eps) if np.dtype(dtype).kind == "f" else 0.0
    return ZERO_TO_PRECISION if negligible(mean, scale, eps) else mean


def _stat_cells(summary: dict, dtype) -> list:
    """min, mean, std, max of ``summary.stats`` (a dash when there were none)."""
    if summary["min"] is None:
        return [MISSING] * 4
    scale = max(abs(summary["min"]), abs(summary["max"]))
    return [summary["min"], _mean_cell(summary["mean"], scale, dtype), summary["std"],
            summary["max"]]


def _non_finite_note(summary: dict) -> str:
    """E.g. "masked: 24 (-inf)", from the counts in ``summary.stats``."""
    notes = {"masked": "masked: {:,} (-inf)", "hidden": "hidden: {:,} (0)", "inf": "+inf: {:,}",
             "nan": "nan: {:,}"}
    return ", ".join(text.format(summary[key]) for key, text in notes.items() if key in summary)


def add_rows(table: Table, mapping: Mapping, max_rows: int | None, make_row, *,
             precision: int = 4, unsigned=(), noise=None) -> None:
    """Add ``make_row(name, value)`` for each item; beyond ``max_rows``, the first and last
    halves around a "… N more" row, and a caption saying how to see them all.

    ``make_row`` is called only for the rows shown. Its float cells are numbers, written with
    one notation per column (:func:`notation`), without a ``+`` in the ``unsigned`` columns;
    other cells are shown as they are. ``noise`` maps a column to the machine epsilon of its
    numbers: there, a value that is rounding noise next to the column's largest is ``≈0``, and
    does not decide the column's notation (b_K's gradient among the others).
    """
    items = list(mapping.items())
    kept = _kept(len(items), max_rows or len(items), max_rows is None)
    made = {i: make_row(*items[i]) for i in kept if i is not None}
    for c, eps in (noise or {}).items():
        scale = max((abs(row[c]) for row in made.values() if isinstance(row[c], float)),
                    default=0.0)
        for row in made.values():
            if isinstance(row[c], float) and negligible(row[c], scale, eps):
                row[c] = ZERO_TO_PRECISION
    styles = {}
    for c in range(len(table.columns)):
        numbers = [row[c] for row in made.values() if isinstance(row[c], float)]
        styles[c] = notation(numbers)
    for row in made.values():
        for c, value in enumerate(row):
            if isinstance(value, float):
                row[c] = _number(value, precision, styles[c], sign=c not in unsigned)
    if any(ZERO_TO_PRECISION in row for row in made.values()):
        table.caption = ZERO_NOTE if table.caption is None else f"{table.caption}\n{ZERO_NOTE}"
    for i in kept:
        if i is None:
            shown = len(kept) - 1
            table.add_row(Text(f"… {len(items) - shown} more", style="dim"),
                          *[""] * (len(table.columns) - 1))
            note = f"showing {shown} of {len(items)} rows; --full shows all"
            table.caption = note if table.caption is None else f"{table.caption}\n{note}"
        else:
            table.add_row(*made[i])


def shape_trace(acts: Mapping[str, np.ndarray], *, precision: int = 4,
                max_rows: int | None = None) -> Table:
    """One row per activation, in the given (forward) order: name, shape and summary statistics.

    Parameters
    ----------
    acts : mapping of str to ndarray
    max_rows : int, optional
        Beyond this many rows, show the first and last halves around a "… N more" row.
        E.g. ``Forward.acts``.
    precision : int

    Returns
    -------
    rich.table.Table
        Columns activation, shape, min, mean, std, max. The statistics are over the finite
        entries only; an activation with -inf / +inf / nan entries gets a ``*`` after its name
        and a footnote counting them (e.g. ``* blocks.0.attn.scores: masked: 24 (-inf)``).
    """
    table = _table()
    table.add_column("activation", overflow="fold")
    table.add_column("shape", justify="right", overflow="fold")
    for header in ("min", "mean", "std", "max"):
        table.add_column(header, justify="right", no_wrap=True, overflow="ellipsis")
    footnotes = []

    def row(name, value):
        summary = activation_stats(name, acts)
        note = _non_finite_note(summary)
        if note:
            footnotes.append(f"* {name}: {note}, left out of the statistics")
        return [name + ("*" if note else ""), _shape(value), *_stat_cells(summary, value.dtype)]

    add_rows(table, acts, max_rows, row, precision=precision, unsigned={4})
    footnotes.append(AXES)
    table.caption = "\n".join(footnotes + ([table.caption] if table.caption else []))
    return table


# What the axes of a shape are, said where a learner reads shapes
AXES = "axes: B batch, T positions, d width, H heads, d_head a head's width, V vocab"


def _check_cells(check) -> list[Text | str]:
    """rel err and pass/fail of one ParamCheck-like object (or dashes when there is none)."""
    if check is None:
        return [MISSING, MISSING]
    mark = Text("✓ pass", style="green") if check.passed else Text("✗ FAIL", style="bold red")
    return [f"{check.rel_err:.2e}", mark]


def grad_table(grads: Mapping[str, np.ndarray], checks: Mapping[str, object] | None = None, *,
               precision: int = 4, max_rows: int | None = None, rope: bool = False) -> Table:
    """One row per parameter gradient: shape, L2 norm, max |g|, mean, and the gradcheck verdict.

    Parameters
    ----------
    grads : mapping of str to ndarray
        Parameter name -> gradient (e.g. ``Gradients``).
    checks : mapping of str to ParamCheck, optional
        Anything with ``rel_err`` and ``passed`` attributes (``checked`` is not shown). Adds
        the columns ``rel err`` and ``check`` (``✓ pass`` / ``✗ FAIL``); parameters without a
        check show ``—`` in both.
    precision : int
    max_rows : int, optional
        Beyond this many rows, show the first and last halves around a "… N more" row.
    rope : bool
        The model turns its queries and keys (``pe="rope"``): b_K's gradient is not 0 there,
        and the note under the table says why instead of calling it noise.

    Returns
    -------
    rich.table.Table
    """
    table = _table()
    table.add_column("parameter", overflow="fold")
    table.add_column("shape", justify="right", overflow="fold")
    for header in ("‖g‖₂", "max |g|", "mean"):
        table.add_column(header, justify="right", no_wrap=True, overflow="ellipsis")
    if checks is not None:
        table.add_column("rel err", justify="right", no_wrap=True, overflow="ellipsis")
        table.add_column("check", no_wrap=True)

    def row(name, grad):
        g = grad if isinstance(grad, Summary) else np.asarray(grad)   # (streamed: a summary)
        largest = max_abs(g)
        cells = [name, _shape(g), l2_norm(g), largest, _mean_cell(mean(g), largest, g.dtype)]
        return cells + (_check_cells(checks.get(name)) if checks is not None else [])

    dtypes = [g.dtype if isinstance(g, Summary) else np.asarray(g).dtype for g in grads.values()]
    eps = max((float(np.finfo(dtype).eps) for dtype in dtypes if dtype.kind == "f"),
              default=0.0)
    add_rows(table, grads, max_rows, row, precision=precision, unsigned={2, 3},
             noise={2: eps, 3: eps, 4: eps})
    if any(name.endswith("attn.b_K") for name in grads):
        note = B_K_ROPE_NOTE if rope else B_K_NOTE
        table.caption = note if table.caption is None else f"{table.caption}\n{note}"
    return table


# d loss / d b_K is 0 in exact arithmetic (docs/derivations.md), whatever the weights and mask.
B_K_NOTE = ("b_K: 0 in exact arithmetic, since q·b_K adds the same number to every score of a "
            "query's row and softmax ignores a shift; its numbers here are rounding noise")
# Under RoPE it is not: key s's bias is turned by s's angles, so q·R_s b_K differs by key.
B_K_ROPE_NOTE = ("b_K: not 0 under RoPE: each key's bias is turned by its own position's angles, "
                 "so q·R_s b_K differs from key to key and softmax sees it")


def config_panel(rows: Mapping[str, str], *, title: str = "config") -> Panel:
    """Key/value pairs as a compact two-column grid in a panel.

    Parameters
    ----------
    rows : mapping of str to str
        E.g. ``{"sizes": "B=2 T=4 d=6 H=2 d_ff=24 V=8 L=1", "norm": "pre-LN"}``.
    title : str

    Returns
    -------
    rich.panel.Panel
    """
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows.items():
        grid.add_row(str(key), str(value))
    # a title string would be read as markup: "query 4:[/quote]" would end no tag and fail
    return Panel(grid, title=Text(title), title_align="left", expand=False)


def shape_list(shapes, *, title=None, max_rows=None) -> Table:
    """A table of name -> shape and element count, e.g. for ``tfm shapes``.

    shapes : mapping name -> tuple of int
    max_rows : beyond this many rows, the first and last halves around a "… N more" row
    """
    table = _table(title)
    table.add_column("name", overflow="fold")
    table.add_column("shape", justify="right")
    table.add_column("elements", justify="right")
    add_rows(table, shapes, max_rows,
             lambda name, shape: [name, str(tuple(shape)), f"{prod(shape):,}"])
    table.caption = AXES if table.caption is None else f"{table.caption}\n{AXES}"
    return table


def record_table(headers, rows, *, title=None, max_rows=None, left=1, precision=4) -> Table:
    """Rows of cells under ``headers``: the first ``left`` columns left-justified (names), the
    rest right-justified (numbers). Float cells are written in one notation per column, with
    ``precision`` digits; other cells as they are. Beyond ``max_rows``, the first and last
    halves around a "… N more" row."""
    table = _table(title)
    table.padding = (0, 1)   # words, not signed numbers: they need a gap of their own
    for j, header in enumerate(headers):
        table.add_column(header, justify="left" if j < left else "right", no_wrap=j >= left)
    add_rows(table, dict(enumerate(rows)), max_rows, lambda _, cells: list(cells),
             precision=precision)
    return table


def side_by_side(*renderables) -> Columns:
    """Renderables next to each other when the terminal is wide enough, else stacked."""
    return Columns(list(renderables), padding=(0, 3))
