"""Layout decisions for attention maps: how many fit a screen, side by side in a grid, and the
one colour scale (and legend) they share."""

from __future__ import annotations

import math

import numpy as np
from rich.columns import Columns
from rich.text import Text

from tfmcli.render.colours import Legend
from tfmcli.render.heatmap import (
    SHADE_WIDTH,
    _beyond,
    _blocks,
    _values_fit,
    downsampled_caption,
    heatmap,
    shows_values,
)

GAP = 3          # columns between two maps of a grid
TITLE = len("block 0 head 0")   # a map is at least as wide as its title
NARROW = 80      # a wider screen shows at least the maps this one does
WEIGHT = 4       # "0.25": an attention weight at two digits, unsigned


def _map_size(seq_len: int, width: int, label_width: int,
              values: bool = True) -> tuple[int, int]:
    """The columns and lines of one (T, T) map as :func:`attention_maps` draws it at
    ``width``, with query and key labels ``label_width`` wide: its title, the key labels, a
    line per query, and the caption of a downsampled map (wrapped at the width, as wide as
    the map is then). Weights are taken at two digits, as they are unless the 99th
    percentile is under 0.04 (a long sequence, drawn in shades). ``values=False``: the size
    in shades, whether values would fit or not."""
    row_block, col_block = _blocks(seq_len, seq_len, label_width, width)
    value_width = max(WEIGHT, label_width)   # a key label wider than the weights widens them
    if (values and (row_block, col_block) == (1, 1)
            and _values_fit(seq_len, label_width, value_width, width)):
        return label_width + 1 + seq_len * (value_width + 2), seq_len + 2
    columns = max(TITLE, label_width + 1 + math.ceil(seq_len / col_block) * SHADE_WIDTH)
    lines = math.ceil(seq_len / row_block) + 2
    if (row_block, col_block) != (1, 1):
        caption = len(downsampled_caption(seq_len, seq_len, row_block, col_block))
        columns = max(columns, min(caption, width))
        lines += math.ceil(caption / max(1, width))
    return columns, lines


def maps_that_fit(pairs: list, seq_len: int, width: int, full: bool, height: int,
                  label_width: int) -> list:
    """The (block, head) pairs whose maps fit a screen of ``width`` x ``height`` in a grid
    (at least one row), their query and key labels ``label_width`` wide; all with ``full``."""
    return pairs if full else _fitting(pairs, seq_len, width, height, label_width, values=True)


def _fitting(pairs, seq_len, width, height, label_width, values):
    map_width, map_height = _map_size(seq_len, width, label_width, values)
    per_row = max(1, (width + GAP) // (map_width + GAP))
    # a blank line between two rows; 4 lines for the heading, the legend (two when it wraps)
    # and the note saying how to see the rest
    grid_rows = max(1, (height - 4) // (map_height + 1))
    return pairs[:per_row * grid_rows]


def maps_layout(pairs: list, seq_len: int, width: int, full: bool, height: int,
                label_width: int) -> tuple[list, bool]:
    """(the pairs whose maps fit, whether their cells show values): values where they fit,
    unless a screen wider than 80 columns would show fewer maps with them than 80 columns
    show; then shades. A wider screen never shows fewer maps (at 120 columns sixteen tokens'
    values made a map too wide for two side by side, where 80 columns drew two in shades)."""
    if full:
        return pairs, True
    with_values = _fitting(pairs, seq_len, width, height, label_width, values=True)
    if width > NARROW:
        at_narrow = _fitting(pairs, seq_len, NARROW, height, label_width, values=True)
        if len(with_values) < len(at_narrow):
            return _fitting(pairs, seq_len, width, height, label_width, values=False), False
    return with_values, True


def quantile(values, q: float) -> float:
    """``np.quantile(values, q)`` of a 1-D array (its linear method), the same number, found
    the same way (two entries put in place by a partial sort, then interpolated), but without
    the ``np.unique`` of ``np.quantile``, whose first call imports ``numpy.ma``: 12-24 ms of a
    command that draws a map."""
    n = values.size
    virtual = (n - 1) * q
    if virtual >= n - 1:
        return float(np.max(values))
    below = math.floor(virtual)
    part = np.partition(values, [below, below + 1, n - 1])
    if np.isnan(part[-1]):   # a NaN sorts last, and makes the quantile NaN
        return float("nan")
    low, high = part[below], part[below + 1]
    gamma = virtual - below
    step = high - low
    return float(high - step * (1 - gamma) if gamma >= 0.5 else low + step * gamma)


def attention_maps(patterns: dict, mask, row: int, width: int, total: int,
                   row_labels=None, col_labels=None, values: bool = True) -> list:
    """Heatmaps of attention patterns ((block, head) -> (T, T)) of one batch row: a heading,
    the maps side by side in a grid that fits ``width``, and one legend for all. ``mask`` is
    the (T, T) mask of every block, or a dict block -> its own (only some blocks sliding).

    One colour scale for all maps, comparable across heads: 0 to the 99th percentile of the
    weights shown (higher ones take the top colour, which the legend marks ``≥``), so that a
    long sequence, whose weights are mostly near 1/T beside a few near 1, still shows its
    structure. ``total`` is how many maps there were to choose from, for the note saying how
    to see the rest.
    """
    masks = [mask[b] if isinstance(mask, dict) else mask for b, _ in patterns]
    T = masks[0].shape[0]
    row_labels = row_labels or [f"q{t}" for t in range(T)]
    col_labels = col_labels or [f"k{t}" for t in range(T)]
    weights = list(patterns.values())
    vmax = quantile(np.concatenate([p[m] for p, m in zip(weights, masks)]), 0.99)
    digits = max(2, 1 - math.floor(math.log10(vmax / 4)))  # legend stops vmax/4 apart differ
    clipped = any(_beyond(p, m, vmax) for p, m in zip(weights, masks))
    maps = [heatmap(pattern, title=f"block {b} head {h}", row_labels=row_labels,
                    col_labels=col_labels, mask=m, width=width, vmin=0.0, vmax=vmax,
                    precision=digits, legend=False, show_values=None if values else False)
            for ((b, h), pattern), m in zip(patterns.items(), masks)]
    values_shown = values and shows_values(weights[0], row_labels, col_labels, width, digits,
                                           masks[0])
    parts = [Text(f"attention patterns, batch row {row}: queries down, keys across", style="bold"),
             Columns(maps, padding=(1, GAP)),
             Legend(0.0, vmax, precision=digits, clipped=clipped, hidden=True,
                    values_shown=values_shown)]
    if total > len(patterns):
        parts.append(Text(f"showing {len(patterns)} of {total} attention maps; "
                          f"pick with --block/--head, or --full for all", style="dim"))
    return parts
