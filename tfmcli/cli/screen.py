"""The screen a view is drawn on: the terminal's size, never below the smallest that tfm's
layouts support.

``COLUMNS=0``, a five-column pane or ``LINES=1`` is a size a terminal can report, and rich takes
it as it is: at width 0 a heatmap divided by it, and a table with a title asserted once its
columns had no room (``Sum of ratios must be > 0``). Every console tfm prints to is floored
here, once (``floored``), so that no view needs its own guard: on a narrower terminal the
output is the floor's, which the terminal wraps. Light on purpose (no NumPy): the help and the
error line use it too.
"""

from __future__ import annotations

# The narrowest view tfm lays out: the default tensor table (a label column, 8 numbers and the
# "…" column between them, one space apart: 10 columns, 9 spaces) keeps a character in every
# column, a heatmap its labels and a column of shades, a panel its edges and a word. Narrower,
# rich drops whole columns and cells, and the help shows only its panels' corners.
MIN_WIDTH = 20
MIN_HEIGHT = 1   # a screenful of maps is then one row of them, as on any short terminal


def floored(console):
    """``console`` drawing at least MIN_WIDTH x MIN_HEIGHT (its size fixed at the floor where
    the terminal, or COLUMNS and LINES, give less); left as it is otherwise."""
    width, height = console.size
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        console.size = (max(width, MIN_WIDTH), max(height, MIN_HEIGHT))
    return console


def columns(measured: int) -> int:
    """A width measured elsewhere (``shutil.get_terminal_size``), floored the same way."""
    return max(measured, MIN_WIDTH)


def size(environ) -> tuple[int, int]:
    """(columns, lines) of COLUMNS and LINES in ``environ``, else 120 x 40 (the explorer's
    screen when it presses --keys without a terminal), each floored."""
    def read(name, default):
        value = environ.get(name, "")
        return int(value) if value.isdigit() else default

    return columns(read("COLUMNS", 120)), max(read("LINES", 40), MIN_HEIGHT)


def floor_the_help() -> None:
    """Typer's help console floored too (its own console, made by ``_get_rich_console`` each
    time help is drawn): called only when the terminal is narrower than the floor."""
    from typer import rich_utils

    made = rich_utils._get_rich_console
    if getattr(made, "floored", False):
        return

    def console(stderr: bool = False):
        return floored(made(stderr=stderr))

    console.floored = True
    rich_utils._get_rich_console = console
