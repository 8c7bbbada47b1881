"""A 2-D array as a grid of coloured cells that still reads with the colours stripped.

Each cell shows its value when the whole grid fits in ``width`` columns, otherwise a
two-character shade (``"▓▓"``); when even two characters per column are too many, blocks of
cells are averaged first. The grid is built line by line as ``Text`` so that the column labels
can be placed like axis ticks over two-character cells.
"""

from __future__ import annotations

import math

import numpy as np
from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.constrain import Constrain
from rich.text import Span, Text

from tfmcli.render.colours import Legend, block_style, cell_style, scale_positions, shade_at
from tfmcli.render.numbers import fmt_fixed
from tfmcli.render.text import Printable


class Drawing(Printable, Constrain):
    """A heatmap: a renderable for rich, and plain text for ``print``."""

HIDDEN = "·"
HIDDEN_STYLE = "dim"
SHADE_WIDTH = 2


def heatmap(
    matrix,
    *,
    title: str | None = None,
    row_labels=None,
    col_labels=None,
    mask=None,
    width: int = 80,
    precision: int = 2,
    vmin: float | None = None,
    vmax: float | None = None,
    diverging: bool = False,
    legend: bool = True,
    show_values: bool | None = None,
) -> RenderableType:
    """A matrix as a grid of cells coloured by value, with labels and a legend.

    Parameters
    ----------
    matrix : (R, C) array_like
        E.g. one head's attention pattern (queries x keys) or a positional encoding.
    title : str, optional
    row_labels, col_labels : sequence of str, optional
        Length R and C; default to the indices ``"0"``, ``"1"``, ...
    mask : (R, C) bool array_like, optional
        True = visible (computed). Hidden cells show a dim ``"·"`` on no background, never a
        colour, so they cannot be mistaken for a computed 0. Without one, a square matrix
        whose rows each sum to 1 and whose cells above the diagonal are exactly 0 is taken
        for a causal attention pattern, and those cells are hidden.
    width : int
        Columns available, labels included. The grid never exceeds it (unless
        ``show_values=True`` forces values that do not fit).
    precision : int
        Digits of the values in the cells and of the legend labels.
    vmin, vmax : float, optional
        Ends of the colour scale; default to the finite min and max of the visible cells.
    diverging : bool
        Blue - white - red centred on 0 (for signed matrices) instead of the sequential
        dark-to-yellow scale (for e.g. probabilities).
    legend : bool
        Add a line explaining the colours/shades and the hidden-cell symbol.
    show_values : bool, optional
        None = values when they fit in ``width``, shades otherwise.

    Returns
    -------
    rich.console.RenderableType
        Title, column labels, one line per row, a caption when downsampled, the legend (a
        ``Group`` of ``Text`` lines, constrained to ``width``).
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"heatmap needs a 2-D array, got shape {matrix.shape}; slice it first")
    rows, cols = matrix.shape
    if mask is None and not diverging:
        mask = _causal_pattern_mask(matrix)
    visible = _visible(mask, matrix.shape)
    row_labels = _labels(row_labels, rows, "row_labels")
    col_labels = _labels(col_labels, cols, "col_labels")
    clipped = _beyond(matrix, visible, vmax)
    vmin, vmax = _scale_ends(matrix, visible, vmin, vmax, diverging)
    label_width = max(map(cell_len, row_labels)) if rows else 0   # a CJK character is 2 wide

    row_block, col_block = _blocks(rows, cols, label_width, width)
    caption = None
    if row_block > 1 or col_block > 1:
        matrix, visible = _block_mean(matrix, visible, row_block, col_block)
        row_labels, col_labels = row_labels[::row_block], col_labels[::col_block]
        caption = downsampled_caption(rows, cols, row_block, col_block)

    texts = None   # cells are two-character shades, unless their values are shown
    if show_values or (show_values is None and caption is None):
        texts, value_width = _cell_texts(matrix, visible, col_labels, precision, diverging)
        values_fit = caption is None and _values_fit(cols, label_width, value_width, width)
        if not (values_fit if show_values is None else show_values):
            texts = None
    cell_width = SHADE_WIDTH if texts is None else value_width + 2  # a space either side

    grid_width = label_width + 1 + matrix.shape[1] * cell_width
    lines: list[RenderableType] = []
    if title:
        lines.append(Text(title.center(grid_width).rstrip(), style="bold"))
    if texts is None:
        lines.append(_tick_header(col_labels, label_width, grid_width))
    else:
        lines.append(_value_header(col_labels, label_width, value_width))
    positions = scale_positions(matrix, vmin, vmax, diverging)
    for i, label in enumerate(row_labels):
        row_texts = [None] * matrix.shape[1] if texts is None else texts[i]
        cells = [_cell(value, seen, text, cell_width, position, diverging)
                 for value, seen, text, position in zip(matrix[i].tolist(), visible[i].tolist(),
                                                        row_texts, positions[i])]
        lines.append(_line([(_rjust(label, label_width) + " ", "dim"), *cells]))
    if caption:
        lines.append(Text(caption, style="dim italic"))
    if legend:
        lines.append(Legend(vmin, vmax, diverging=diverging, precision=precision,
                            clipped=clipped, hidden=mask is not None,
                            values_shown=texts is not None))
    # Title, caption and legend wrap at ``width``; grid lines are never wider unless forced.
    # (a title wider than a narrow map is not wrapped: "block 0 head" over a lone "0")
    narrow = max(grid_width, cell_len(title) if title else 0)
    return Drawing(Group(*lines), max(width, grid_width) if legend or caption else narrow)


def shows_values(matrix, row_labels, col_labels, width: int, precision: int = 2,
                 mask=None, diverging: bool = False) -> bool:
    """Whether :func:`heatmap` prints the values of ``matrix`` in its cells at ``width`` (they
    fit without downsampling), rather than shades."""
    matrix = np.asarray(matrix, dtype=np.float64)
    rows, cols = matrix.shape
    label_width = max((cell_len(str(label)) for label in row_labels), default=0)
    if _blocks(rows, cols, label_width, width) != (1, 1):
        return False
    _, value_width = _cell_texts(matrix, _visible(mask, matrix.shape), [str(c) for c in col_labels],
                                 precision, diverging)
    return _values_fit(cols, label_width, value_width, width)


def _causal_pattern_mask(matrix: np.ndarray):
    """The causal mask, when ``matrix`` is a causal attention pattern (rows summing to 1,
    exactly 0 above the diagonal and more than 0 on and below it, as a softmax is); else None.
    The identity, 0 below its diagonal too, is not taken for one."""
    rows, cols = matrix.shape
    if rows < 2 or rows != cols or not np.all(np.isfinite(matrix)):
        return None
    above = np.triu(np.ones((rows, cols), dtype=bool), k=1)
    if (np.any(matrix[above] != 0) or np.any(matrix[~above] <= 0)
            or not np.allclose(matrix.sum(axis=1), 1.0, atol=1e-6)):
        return None
    return ~above


def downsampled_caption(rows: int, cols: int, row_block: int, col_block: int) -> str:
    """The line under a map whose cells are block means."""
    return (f"downsampled {rows}x{cols} -> {math.ceil(rows / row_block)}x"
            f"{math.ceil(cols / col_block)}, block mean of up to {row_block}x{col_block} "
            f"visible cells")


def _cell_texts(matrix, visible, col_labels, precision, diverging):
    """Each cell's value as text (signed only when some visible value is negative, or on a
    diverging scale: probabilities need no "+"), and the width a column of them needs."""
    signed = diverging or bool((matrix[visible] < 0).any())
    texts = [[fmt_fixed(v, precision, signed) for v in row] for row in matrix]
    value_width = max([len(t) for row in texts for t in row] + [cell_len(c) for c in col_labels],
                      default=1)
    return texts, value_width


def _values_fit(cols: int, label_width: int, value_width: int, width: int) -> bool:
    return label_width + 1 + cols * (value_width + 2) <= width   # a space either side of each


def _blocks(rows: int, cols: int, label_width: int, width: int) -> tuple[int, int]:
    """How many rows and columns each drawn cell averages. Two characters per column must fit;
    rows are averaged in blocks as wide as the columns' (two characters are about as wide as
    one line is tall), and there are at most ``width`` of them (one, at a width of 0)."""
    max_cols = max(1, (width - label_width - 1) // SHADE_WIDTH)
    col_block = math.ceil(cols / max_cols)
    return max(col_block, math.ceil(rows / max(1, width))), col_block


def _beyond(matrix, visible, vmax) -> bool:
    """Whether visible values exceed a given top of the scale (by more than rounding)."""
    if vmax is None:
        return False
    shown = matrix[visible & np.isfinite(matrix)]
    return bool(shown.size) and float(shown.max()) > vmax + 1e-9 * max(abs(vmax), 1e-300)


def _visible(mask, shape) -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != shape:
        raise ValueError(f"mask has shape {mask.shape} but the matrix has shape {shape}")
    return mask


def _labels(labels, n: int, name: str) -> list[str]:
    if labels is None:
        return [str(i) for i in range(n)]
    labels = [str(label) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} entries for {n} rows/columns")
    return labels


def _scale_ends(matrix, visible, vmin, vmax, diverging) -> tuple[float, float]:
    """Default ends: the finite extremes of the visible cells; symmetric about 0 if diverging."""
    shown = matrix[visible & np.isfinite(matrix)]
    low = float(shown.min()) if shown.size else 0.0
    high = float(shown.max()) if shown.size else 1.0
    if diverging:
        limit = max(abs(low), abs(high))
        low, high = -limit, limit
    return (low if vmin is None else float(vmin)), (high if vmax is None else float(vmax))


def _block_mean(matrix, visible, row_block: int, col_block: int):
    """Average blocks of visible cells; a block is hidden only if all its cells are. (At once
    over the blocks: one at a time, a 1024 x 1024 map's 54 x 54 blocks took 12 ms.)"""
    rows = math.ceil(matrix.shape[0] / row_block)
    cols = math.ceil(matrix.shape[1] / col_block)
    values = np.zeros((rows * row_block, cols * col_block))   # edge blocks padded, hidden
    seen = np.zeros(values.shape, dtype=bool)
    values[:matrix.shape[0], :matrix.shape[1]] = np.where(visible, matrix, 0.0)
    seen[:matrix.shape[0], :matrix.shape[1]] = visible
    sums = values.reshape(rows, row_block, cols, col_block).sum(axis=(1, 3))
    counts = seen.reshape(rows, row_block, cols, col_block).sum(axis=(1, 3))
    shown = counts > 0
    return np.divide(sums, counts, out=np.zeros((rows, cols)), where=shown), shown


def _value_header(col_labels, label_width: int, value_width: int) -> Text:
    header = " " * (label_width + 1)
    header += "".join(" " + _rjust(label, value_width) + " " for label in col_labels)
    return Text(header.rstrip(), style="dim")


def _tick_header(col_labels, label_width: int, grid_width: int) -> Text:
    """Labels over two-character cells, like axis ticks: every ``step``-th column has room."""
    longest = max(map(cell_len, col_labels), default=1)
    step = math.ceil((longest + 1) / SHADE_WIDTH)
    header = [" "] * grid_width   # one entry per column of the screen
    for j in range(0, len(col_labels), step):
        start = label_width + 1 + j * SHADE_WIDTH
        label = _screen_columns(col_labels[j])
        if start + len(label) <= grid_width:
            header[start:start + len(label)] = label
    return Text("".join(header).rstrip(), style="dim")


def _screen_columns(text: str) -> list[str]:
    """One entry per column of the screen: a wide character (CJK, an emoji), then "" for its
    second column; a combining mark joins the character before it."""
    columns: list[str] = []
    for char in text:
        width = cell_len(char)
        if width == 0 and columns:
            columns[-1] += char
        else:
            columns += [char] + [""] * (width - 1)
    return columns


def _rjust(text: str, width: int) -> str:
    """``text.rjust(width)`` in columns of the screen, where a CJK character or an emoji takes 2."""
    return " " * (width - cell_len(text)) + text


def _cell(value, visible, text, width, position, diverging) -> tuple[str, object]:
    """Characters and style of one cell: ``text`` (a value) padded to ``width``, or a shade;
    ``position``: the value's place on the scale (``scale_positions``)."""
    if not visible:
        return HIDDEN.center(width), HIDDEN_STYLE
    if text is not None:
        padded = " " + text.rjust(width - 2) + " "
        if not math.isfinite(value):
            return padded, "dim"
        return padded, cell_style(position, diverging)
    if math.isnan(value):
        return " ?", "dim"
    if math.isinf(value):
        return ("+∞" if value > 0 else "-∞"), "dim"
    return shade_at(position, diverging), block_style(position, diverging)


def _line(pieces) -> Text:
    """A line of (characters, style) pieces, as ``Text.append`` would build it piece by piece,
    made at once (appending took a third of a map's time)."""
    spans, start = [], 0
    for characters, style in pieces:
        if style:
            spans.append(Span(start, start + len(characters), style))
        start += len(characters)
    return Text("".join(characters for characters, _ in pieces), spans=spans)
