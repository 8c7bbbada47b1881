"""Colour scales, the matching shade characters, and the legend that explains both.

A value is placed on a scale twice: as a background colour (for colour terminals) and as a
two-character shade such as ``"▓▓"`` (which survives when the colours are stripped). Both come
from the same position on the scale, so the legend can show them side by side.
"""

from __future__ import annotations

import functools

import numpy as np
from rich.color import Color
from rich.style import Style
from rich.text import Text

from tfmcli.render.numbers import fmt

# Anchor colours, low to high, interpolated linearly in between. Sequential: viridis (dark
# purple -> yellow, readable on dark and light terminals). Diverging: red (negative) - white (0) -
# blue (positive): red means negative everywhere in tfm, as in the tables of numbers.
SEQUENTIAL = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
DIVERGING = [(178, 24, 43), (239, 138, 98), (247, 247, 247), (103, 169, 207), (33, 102, 172)]

SHADES = " ░▒▓█"  # five levels, from the bottom of the scale to the top
LEGEND_STOPS = 5


def scale_position(value: float, vmin: float, vmax: float, diverging: bool) -> float:
    """Where ``value`` sits on the scale: 0 (bottom) .. 1 (top), clipped.

    A diverging scale puts 0 exactly in the middle (0.5) whatever ``vmin`` and ``vmax`` are, so
    that white always means zero; each side is stretched to its own end.
    """
    if diverging:
        if value == 0:
            return 0.5
        if value < 0:
            side = -value / -vmin if vmin < 0 else 1.0
            return 0.5 - 0.5 * min(side, 1.0)
        side = value / vmax if vmax > 0 else 1.0
        return 0.5 + 0.5 * min(side, 1.0)
    if vmax <= vmin:
        return 0.0
    return float(np.clip((value - vmin) / (vmax - vmin), 0.0, 1.0))


def scale_positions(values, vmin: float, vmax: float, diverging: bool) -> list:
    """``scale_position`` of every entry of the 2-D ``values`` at once, as nested lists of
    floats: the same numbers (the same operations, made on the array). An entry that is not
    finite gets no meaningful position: a cell shows those apart."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if not diverging:
            if vmax <= vmin:
                return np.zeros(values.shape).tolist()
            return np.clip((values - vmin) / (vmax - vmin), 0.0, 1.0).tolist()
        below = np.minimum(-values / -vmin, 1.0) if vmin < 0 else 1.0
        above = np.minimum(values / vmax, 1.0) if vmax > 0 else 1.0
        return np.where(values == 0, 0.5, np.where(values < 0, 0.5 - 0.5 * below,
                                                   0.5 + 0.5 * above)).tolist()


def colour_at(position: float, diverging: bool) -> tuple[int, int, int]:
    """The RGB colour at ``position`` (0..1) of the sequential or diverging scale."""
    anchors = DIVERGING if diverging else SEQUENTIAL
    x = position * (len(anchors) - 1)
    i = min(int(x), len(anchors) - 2)
    frac = x - i
    low, high = anchors[i], anchors[i + 1]
    return tuple(round(a + (b - a) * frac) for a, b in zip(low, high))


def level(position: float, diverging: bool) -> float:
    """``position`` moved to the nearest of the scale's levels, the legend's swatches: five
    from bottom to top, or nine on a diverging scale (four either side of white). A cell's
    colour is then one of the legend's, on any terminal: a 256-colour one rounds nearby
    colours of a continuous scale to different palette entries, so that equal-looking values
    jittered between two colours."""
    if not diverging:
        return round(position * 4) / 4
    steps = round(abs(position - 0.5) * 8)
    return 0.5 + (steps if position > 0.5 else -steps) / 8


def cell_style(position: float, diverging: bool) -> Style:
    """Background from the scale (at its level), black or white text, whichever reads better."""
    return _on_background(colour_at(level(position, diverging), diverging))


def block_style(position: float, diverging: bool) -> Style:
    """Text and background in the same colour: a solid block that still carries its shade."""
    return _solid(colour_at(level(position, diverging), diverging))


# A map has thousands of cells and a few hundred colours: each colour's style is made once.
@functools.lru_cache(maxsize=4096)
def _on_background(rgb: tuple[int, int, int]) -> Style:
    r, g, b = rgb
    luminance = 0.299 * r + 0.587 * g + 0.114 * b
    foreground = Color.from_rgb(0, 0, 0) if luminance > 140 else Color.from_rgb(255, 255, 255)
    return Style(color=foreground, bgcolor=Color.from_rgb(r, g, b))


@functools.lru_cache(maxsize=4096)
def _solid(rgb: tuple[int, int, int]) -> Style:
    colour = Color.from_rgb(*rgb)
    return Style(color=colour, bgcolor=colour)


def shade_at(position: float, diverging: bool) -> str:
    """Two characters that stand in for the colour when there is none.

    Sequential: ``"  "``, ``"░░"``, ``"▒▒"``, ``"▓▓"``, ``"██"`` from bottom to top.
    Diverging: the sign then the magnitude, ``"-█"`` .. ``"  "`` (near 0) .. ``"+█"``.
    """
    if not diverging:
        return SHADES[round(position * 4)] * 2
    magnitude = round(abs(position - 0.5) * 8)  # 0..4
    if magnitude == 0:
        return "  "
    return ("+" if position > 0.5 else "-") + SHADES[magnitude]


def legend_stops(vmin: float, vmax: float, diverging: bool) -> list[float]:
    """The values labelled in a legend, one per level of the scale (``level``); a diverging
    legend always includes 0."""
    if diverging:
        low, high = min(vmin, 0.0), max(vmax, 0.0)
        return [low, low * 3 / 4, low / 2, low / 4, 0.0, high / 4, high / 2, high * 3 / 4, high]
    if vmax <= vmin:
        return [vmin]
    return list(np.linspace(vmin, vmax, LEGEND_STOPS))


def colour_legend(vmin: float, vmax: float, *, diverging: bool = False, precision: int = 2,
                  clipped: bool = False) -> Text:
    """One line: each swatch in brackets, then the value it stands for, from ``vmin`` to ``vmax``.

    Each swatch is the colour of that value and carries the shade characters a heatmap uses
    without colour, so the legend reads in both; the brackets show where a blank swatch is.

    Parameters
    ----------
    vmin, vmax : float
        The ends of the scale.
    diverging : bool
        Red (negative) - white (0) - blue (positive) instead of the sequential scale.
    precision : int
        Digits of the labels (formatted with :func:`fmt`; unsigned when the scale is).
    clipped : bool
        Values above ``vmax`` exist and take the top swatch: its label reads ``≥vmax``.

    Returns
    -------
    rich.text.Text
        Uncoloured: ``"scale [  ] 0.00  [░░] 0.25  [▒▒] 0.50  [▓▓] 0.75  [██] 1.00"``.
    """
    return Legend(vmin, vmax, diverging=diverging, precision=precision,
                  clipped=clipped).lines(colour=True, width=10 ** 6)[0]


def _scale_items(vmin, vmax, diverging, precision, clipped) -> list[Text]:
    """``scale``, then one ``[swatch] value`` per stop: the pieces a legend never breaks."""
    signed = diverging or vmin < 0
    stops = legend_stops(vmin, vmax, diverging)
    items = [Text("scale, red < 0 < blue" if diverging else "scale", style="dim")]
    for k, value in enumerate(stops):
        position = scale_position(value, vmin, vmax, diverging)
        item = Text()
        item.append("[", style="dim")
        item.append(shade_at(position, diverging), style=block_style(position, diverging))
        item.append("]", style="dim")
        top = clipped and k == len(stops) - 1
        item.append((" ≥" if top else " ") + fmt(value, precision, sign=signed).strip())
        items.append(item)
    return items


class Legend:
    """The key under one or more heatmaps: the colour scale and the hidden-cell symbol.

    When the cells print their values and the console has no colour, the swatches stand for
    nothing on the screen and are left out (only the hidden-cell symbol is explained).
    """

    def __init__(self, vmin, vmax, *, diverging=False, precision=2, clipped=False,
                 hidden=False, values_shown=False):
        self.scale = _scale_items(vmin, vmax, diverging, precision, clipped)
        self.hidden, self.values_shown = hidden, values_shown

    def lines(self, colour: bool, width: int) -> list[Text]:
        """The key in lines of at most ``width`` cells, broken only between its pieces (a
        swatch with its value, ``· hidden by mask``), never inside one; a line after the first
        starts under the first swatch. A piece wider than ``width`` on its own is left to
        wrap."""
        pieces = []   # (the gap before it, the piece)
        if colour or not self.values_shown:
            label, first, *rest = self.scale
            pieces = [("", label), (" ", first)] + [("  ", item) for item in rest]
        if self.hidden:
            hidden = Text.assemble(("·", "dim"), " hidden by mask")
            pieces.append(("   " if pieces else "", hidden))
        indent = " " * (self.scale[0].cell_len + 1) if len(pieces) > 1 else ""
        lines: list[Text] = []
        for k, (gap, piece) in enumerate(pieces):
            if k == 0 or lines[-1].cell_len + len(gap) + piece.cell_len > width:
                lines.append(Text(indent if k else ""))
                gap = ""
            lines[-1].append(gap)
            lines[-1].append_text(piece)
        return lines

    def __rich_console__(self, console, options):
        yield from self.lines(console.color_system is not None, options.max_width)
