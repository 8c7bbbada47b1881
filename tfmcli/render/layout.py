"""Small layout helpers: shape listings and side-by-side panels."""

from __future__ import annotations

from math import prod

from rich.columns import Columns
from rich.table import Table

from tfmcli.render.tables import _table, add_rows


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
    return table


def side_by_side(*renderables) -> Columns:
    """Renderables next to each other when the terminal is wide enough, else stacked."""
    return Columns(list(renderables), padding=(0, 3))
