"""Lines of prose and formulas wrapped where a reader would break them.

Rich wraps a ``Text`` at any space, so a formula breaks mid-expression (``... / sqrt(var +
eps) +`` then ``beta``) and a figure loses its unit (``4.1`` then ``K``). Here a line breaks
first between its clauses (after ``;`` or ``:``, at two spaces, which tfm puts between the
formulas of a line), then after a list's commas, and only when a piece is still wider than the
screen at a space outside any brackets that does not part a number from its unit, nor a word
from the number after it. A clause that fits is never broken.
"""

from __future__ import annotations

import re

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

# where one clause ends and the next begins: the spaces after "; ", ": " or ", ", or a run of
# two or more spaces
CLAUSE = re.compile(r"(?<=[;:])\s+|(?<=,)\s{2,}|\s{2,}")
COMMA = re.compile(r"(?<=,)\s")   # within a clause too long for the line
UNIT = re.compile(r"\d \S")   # "4.1 K", "384 B", "2 x": a number keeps what follows it


def break_points(line: str, width: int) -> list[int]:
    """Offsets at which to break ``line`` so that each piece fits ``width`` cells, clauses kept
    whole where they fit (the pieces' leading spaces are dropped by the caller)."""
    if cell_len(line) <= width:
        return []
    depth = _depths(line)
    clauses = [m.end() for m in CLAUSE.finditer(line) if depth[m.start()] == 0]
    commas = [m.end() for m in COMMA.finditer(line) if depth[m.start()] == 0]
    words = _word_breaks(line, depth)
    return _pack(line, 0, len(line), width, [clauses, commas, words])


def _pack(line: str, start: int, end: int, width: int, levels: list) -> list[int]:
    """Breaks of ``line[start:end]``: its pieces between the first level's break points packed
    greedily into lines; a piece wider than ``width`` broken at the next level's."""
    points = [p for p in levels[0] if start < p < end]
    pieces = list(zip([start, *points], [*points, end]))
    cuts, line_start = [], start
    lists = len(levels) == 2   # the commas: a list's items may share a line with words
    for a, b in pieces:
        if a > line_start and cell_len(line[line_start:b].rstrip()) > width:
            half = cell_len(line[line_start:a]) >= width // 2
            # a piece wider than a line is broken anyway: after a short start ("backward:") it
            # fills the line; a list's items share one with words unless half of it is taken
            whole = cell_len(line[a:b].strip()) <= width or len(levels) == 1 or half
            if whole and (not lists or half):
                cuts.append(a)     # the piece goes to the next line, whole
                line_start = a
        if cell_len(line[line_start:b].rstrip()) > width and len(levels) > 1:
            inner = _pack(line, line_start, b, width, levels[1:])
            cuts += inner
            line_start = inner[-1] if inner else line_start
    return cuts


def _depths(line: str) -> list[int]:
    """How many brackets are open at each offset of ``line``."""
    depths, depth = [], 0
    for char in line:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        depths.append(depth)
    return depths


def _word_breaks(line: str, depth: list[int]) -> list[int]:
    """Where a clause may break when nothing else will do: after a space outside brackets,
    not between a number and its unit, nor before a number ("position 3")."""
    return [i + 1 for i, char in enumerate(line[:-1])
            if char == " " and depth[i] == 0 and not UNIT.match(line, i - 1)
            and not line[i + 1].isdigit()]


class Wrapped:
    """A ``Text`` printed with :func:`break_points`; its styles are kept."""

    def __init__(self, text: Text):
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.text.split("\n"):
            cuts = break_points(line.plain, width)
            for piece in line.divide(cuts) if cuts else [line]:
                if cuts:
                    piece.rstrip()
                    left = len(piece.plain) - len(piece.plain.lstrip(" "))
                    piece = piece[left:]
                yield piece

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.text)


def wrapped(item):
    """``item`` wrapped as a reader would, when it is a left-aligned ``Text``; else itself."""
    if isinstance(item, Text) and item.justify in (None, "default", "left"):
        return Wrapped(item)
    return item
