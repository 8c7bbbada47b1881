"""A curve drawn in the terminal: one column of eighth-blocks per group of steps."""

from __future__ import annotations

import numpy as np
from rich.console import Group
from rich.text import Text

from tfmcli.render.numbers import fmt, notation

BLOCKS = " ▁▂▃▄▅▆▇█"  # 0..8 eighths of a cell


def _labels(top: float, bottom: float) -> tuple[str, str]:
    """The y axis's top and bottom labels in one notation, as a table writes a column: a loss
    falling from 4.2 to 3e-4 is labelled ``4.200e+00`` over ``3.000e-04``, not ``4.200`` over
    ``3.000e-04``. A zero is ``0.000`` in either notation, as in the tables."""
    style = notation([top, bottom])
    precision = 3 if max(abs(top), abs(bottom)) < 1e5 else 2
    return tuple(fmt(v, precision, style).strip().lstrip("+") for v in (top, bottom))


def curve(xs, ys, *, title: str, width: int, height: int = 8, log: bool = False,
          style: str = "cyan") -> Group:
    """``ys`` against ``xs`` as a filled area chart ``height`` rows tall, fitted to ``width``.

    Each column stands for a run of consecutive points and shows their mean (on a ``log``
    scale, the mean of the logarithms). The y axis is labelled at its top and bottom, the x
    axis at its ends.

    Parameters
    ----------
    xs, ys : sequences of the same length
    log : bool
        A logarithmic y axis (for a loss falling over orders of magnitude).
    """
    ys = np.asarray(ys, dtype=np.float64)
    values = np.log10(np.maximum(ys, 1e-300)) if log else ys
    top_label, bottom_label = _labels(ys.max(), ys.min() if log else min(ys.min(), 0.0))
    label_width = max(len(top_label), len(bottom_label))
    columns = max(1, min(len(ys), width - label_width - 2))
    groups = np.array_split(values, columns)
    means = np.array([g.mean() for g in groups])
    low, high = float(values.min()), float(values.max())
    if not log:   # an area stands on zero
        low, high = min(low, 0.0), max(high, 0.0)
    span = high - low if high > low else 1.0
    eighths = np.round((means - low) / span * (height * 8 - 1)).astype(int) + 1  # 1..8 height

    lines = [Text(title, style="bold")]
    for r in range(height - 1, -1, -1):           # top row first
        fill = np.clip(eighths - r * 8, 0, 8)
        label = top_label if r == height - 1 else bottom_label if r == 0 else ""
        line = Text(label.rjust(label_width) + " ┤" if label else " " * label_width + " │",
                    style="dim")
        line.append("".join(BLOCKS[f] for f in fill).rstrip(), style=style)
        lines.append(line)
    first, last = str(xs[0]), str(xs[-1])
    axis = " " * (label_width + 2) + first
    axis += last.rjust(max(label_width + 2 + columns - len(axis), len(last) + 1))   # a space apart
    lines.append(Text(axis, style="dim"))
    if log:
        lines.append(Text(" " * (label_width + 2) + "(log scale)", style="dim"))
    return Group(*lines)
