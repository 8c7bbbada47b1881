"""Layout decisions for attention maps: how many fit a screen, and the colour scale they share."""

from __future__ import annotations

import math

import numpy as np
from rich.text import Text

from tfmcli.render.heatmap import heatmap

MAX_MAPS = 8
SCREEN_ROWS = 80


def maps_that_fit(pairs: list, seq_len: int, width: int, full: bool) -> list:
    """About a screenful of (block, head) pairs: eight small maps, or a single long one.

    A map is drawn at most (width - 6) / 2 rows tall: downsampled to fit the width, it stays
    square.
    """
    if full:
        return pairs
    map_rows = min(seq_len, (width - 6) // 2) + 4
    return pairs[:max(1, min(MAX_MAPS, SCREEN_ROWS // map_rows))]


def attention_maps(patterns: dict, mask, row: int, width: int, total: int,
                   row_labels=None, col_labels=None) -> list:
    """Heatmaps of attention patterns ((block, head) -> (T, T)) of one batch row, one scale.

    One colour scale for all maps, comparable across heads: 0 to the 99th percentile of the
    weights shown (higher ones saturate), so that a long sequence, whose weights are mostly near
    1/T beside a few near 1, still shows its structure. ``total`` is how many maps there were
    to choose from, for the note saying how to see the rest.
    """
    T = mask.shape[0]
    row_labels = row_labels or [f"q{t}" for t in range(T)]
    col_labels = col_labels or [f"k{t}" for t in range(T)]
    values = list(patterns.values())
    vmax = float(np.quantile(np.concatenate([p[mask] for p in values]), 0.99))
    digits = max(2, 1 - math.floor(math.log10(vmax / 4)))  # legend stops vmax/4 apart differ
    maps = [heatmap(pattern, title=f"block {b} head {h}: attention pattern, batch row {row}",
                    row_labels=row_labels, col_labels=col_labels, mask=mask, width=width,
                    vmin=0.0, vmax=vmax, precision=digits)
            for (b, h), pattern in patterns.items()]
    if any(p.max() > vmax for p in values):
        maps.append(Text(f"colour scale 0..{vmax:.{digits}f}, the 99th percentile of the "
                         f"weights shown; larger weights take the top colour", style="dim"))
    if total > len(patterns):
        maps.append(Text(f"showing {len(patterns)} of {total} attention maps; "
                         f"pick with --block/--head, or --full for all", style="dim"))
    return maps
