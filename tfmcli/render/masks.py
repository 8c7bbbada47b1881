"""Attention masks as grids of symbols: which key each query may attend to."""

from __future__ import annotations

import math

import numpy as np
from rich.cells import cell_len
from rich.console import Group
from rich.text import Text

ATTEND, HIDDEN, SOME = "●", "·", "◐"
ATTEND_ADDITIVE, HIDDEN_ADDITIVE = "0", "-inf"
ATTEND_STYLE, HIDDEN_STYLE = "green", "dim"


def mask_grid(mask, *, title: str | None = None, additive: bool = False, row_labels=None,
              col_labels=None) -> Group:
    """A boolean mask as a grid: ``●`` may attend, ``·`` hidden (or ``0`` / ``-inf``).

    Parameters
    ----------
    mask : (R, C) bool array_like
        True = may attend; rows are queries (or batch rows, for a padding mask), columns keys.
    title : str, optional
        Centred above the grid, or sticking out of it when longer (the grid never widens).
    additive : bool
        Show the 0 / -inf form that is added to the scores instead of the symbols.
    row_labels, col_labels : sequence of str, optional
        Default to the indices.

    Returns
    -------
    rich.console.Group
        Lines of text: a grid of fixed-width characters needs no table layout (which took most
        of ``tfm mask``'s time).
    """
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask_grid needs a 2-D mask, got shape {mask.shape}; slice it first")
    row_labels, col_labels = _labels(mask.shape, row_labels, col_labels)
    attend, hidden = _symbols(additive)
    label_width, widths, grid_width = _grid_columns(row_labels, col_labels, additive)
    lines = [Text(title.center(grid_width).rstrip(), style="italic")] if title else []
    lines.append(Text(" " * label_width + "".join(" " + label.rjust(width) for label, width
                                                  in zip(col_labels, widths)), style="dim"))
    lines.append(Text("─" * grid_width))
    for label, row in zip(row_labels, mask.astype(bool)):
        line = Text()   # the label dim, not the whole line (a Text's style is its base)
        line.append(label.rjust(label_width), style="dim")
        for on, width in zip(row, widths):
            line.append(" " + (attend if on else hidden).rjust(width),
                        style=ATTEND_STYLE if on else HIDDEN_STYLE)
        lines.append(line)
    return Group(*lines)


def _labels(shape, row_labels, col_labels) -> tuple[list, list]:
    rows, cols = shape
    return ([str(i) for i in range(rows)] if row_labels is None else list(row_labels),
            [str(j) for j in range(cols)] if col_labels is None else list(col_labels))


def _symbols(additive: bool) -> tuple[str, str]:
    return (ATTEND_ADDITIVE, HIDDEN_ADDITIVE) if additive else (ATTEND, HIDDEN)


def _grid_columns(row_labels, col_labels, additive) -> tuple[int, list[int], int]:
    """The width of the row labels, of each key's column (its label or its symbol), and of
    the whole grid: the labels, then a space and a column per key."""
    label_width = max(map(cell_len, row_labels), default=0)
    widths = [max(cell_len(label), *map(cell_len, _symbols(additive))) for label in col_labels]
    return label_width, widths, label_width + sum(width + 1 for width in widths)


def mask_grid_width(shape, *, additive: bool = False, row_labels=None, col_labels=None) -> int:
    """The columns :func:`mask_grid` takes for a mask of ``shape`` (its title aside)."""
    return _grid_columns(*_labels(shape, row_labels, col_labels), additive)[2]


def mask_overview(mask, *, title: str, width: int, row_labels=None, col_labels=None,
                  row_group: int = 1) -> Group:
    """A mask too big for one labelled cell per entry: one character per group of keys that
    fits ``width`` and one line per group of ``row_group`` rows, with ``●`` when every entry
    of the group may attend, ``·`` when none may and ``◐`` when some may. Nothing is averaged:
    a mask is true or false.

    Parameters
    ----------
    mask : (R, C) bool array_like
    title : str
    width : int
        Columns available, row labels included.
    row_labels, col_labels : sequence of str, optional
        Default to the indices; a line is labelled with its group's first row, and every few
        characters with their group's first key.
    row_group : int
        Rows per line (1: every row its own line, as a padding mask needs).
    """
    mask = np.asarray(mask, dtype=bool)
    rows, cols = mask.shape
    row_labels = [str(i) for i in range(rows)] if row_labels is None else list(row_labels)
    col_labels = [str(j) for j in range(cols)] if col_labels is None else list(col_labels)
    label_width = max(len(label) for label in row_labels[::row_group])
    key_group = math.ceil(cols / max(1, width - label_width - 1))
    lines_count, chars = math.ceil(rows / row_group), math.ceil(cols / key_group)
    lines = [Text(title, style="bold")]
    header = [" "] * (label_width + 1 + chars)
    step = max(len(label) for label in col_labels[::key_group]) + 1
    for c in range(0, chars, step):
        label = col_labels[c * key_group]
        start = label_width + 1 + c
        if start + len(label) <= len(header):
            header[start:start + len(label)] = label
    lines.append(Text("".join(header).rstrip(), style="dim"))
    for i in range(lines_count):
        line = Text()   # the label dim, not the whole line (a Text's style is its base)
        line.append(row_labels[i * row_group].rjust(label_width) + " ", style="dim")
        block_rows = mask[i * row_group:(i + 1) * row_group]
        for c in range(chars):
            group = block_rows[:, c * key_group:(c + 1) * key_group]
            if group.all():
                line.append(ATTEND, style=ATTEND_STYLE)
            elif group.any():
                line.append(SOME, style=ATTEND_STYLE)
            else:
                line.append(HIDDEN, style=HIDDEN_STYLE)
        lines.append(line)
    if key_group > 1 or row_group > 1:
        parts = ([f"{row_group} rows per line"] if row_group > 1 else []) + \
                ([f"{key_group} keys per character"] if key_group > 1 else [])
        lines.append(Text(f"{' and '.join(parts)}: {ATTEND} all may attend, {SOME} some, "
                          f"{HIDDEN} none", style="dim italic"))
    return Group(*lines)


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


def grids_side_by_side(*blocks) -> "SideBySide":
    """Mask grids (or other blocks of text lines) next to each other when the terminal is wide
    enough, else stacked: ``side_by_side`` for lines of text, without rich's table."""
    return SideBySide(*blocks)


class SideBySide:
    """Blocks of text lines (mask grids, a Group of Text lines or a Text) next to each other,
    laid out as rich's ``Columns(blocks, padding=(0, gap))`` lays them out: as many to a row
    as fit the width, each column as wide as its widest block, shorter blocks padded with
    blank lines. Drawn here from the lines themselves, with no table (rich's table module is
    a tenth of ``tfm mask``'s start-up); a block wider than the width goes to Columns, which
    wraps it."""

    def __init__(self, *blocks, gap: int = 3):
        self.blocks, self.gap = blocks, gap

    def __rich_console__(self, console, options):
        if not self.blocks:
            return
        blocks = [_lines(block) for block in self.blocks]
        widths = [max((line.cell_len for line in lines), default=0) for lines in blocks]
        if max(widths) > options.max_width:
            from rich.columns import Columns
            yield Columns(list(self.blocks), padding=(0, self.gap))
            return
        count = _columns_that_fit(widths, options.max_width, self.gap)
        column_widths = [max(widths[c::count]) for c in range(count)]
        for start in range(0, len(blocks), count):
            row = blocks[start:start + count] + [[]] * (count - len(blocks[start:start + count]))
            for i in range(max(map(len, row))):
                line = Text()
                for c, (lines, column_width) in enumerate(zip(row, column_widths)):
                    part = lines[i].copy() if i < len(lines) else Text()
                    part.pad_right(column_width - part.cell_len)   # in its own base style
                    line.append_text(part)
                    if c < count - 1:
                        line.append(" " * self.gap)
                yield line


def _lines(block) -> list:
    """A block's lines of Text: a Group's renderables, or a Text split at its newlines."""
    if isinstance(block, Text):
        return block.split("\n")
    return list(block.renderables)


def _columns_that_fit(widths: list, max_width: int, gap: int) -> int:
    """How many blocks to a row, found as rich's Columns finds it: from all of them down,
    laying the blocks out row by row and dropping a column whenever the widest of each
    column, with the gaps, passes the width."""
    count = len(widths)
    while count > 1:
        column_widths: dict = {}
        for index, width in enumerate(widths + [0] * (-len(widths) % count)):
            column = index % count
            column_widths[column] = max(column_widths.get(column, 0), width)
            if sum(column_widths.values()) + gap * (len(column_widths) - 1) > max_width:
                count = len(column_widths) - 1
                break
        else:
            break
    return count
