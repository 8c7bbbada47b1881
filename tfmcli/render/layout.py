"""Small layout helpers: shape listings and side-by-side panels."""

from __future__ import annotations

from rich.columns import Columns
from rich.table import Table


def shape_list(shapes, *, title=None, max_rows=None) -> Table:
    """A table of name -> shape (and element count), e.g. for ``tfm shapes``.

    shapes : mapping name -> tuple of int
    """
    table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    table.add_column("name")
    table.add_column("shape", justify="right")
    table.add_column("elements", justify="right")
    items = list(shapes.items())
    if max_rows is not None and len(items) > max_rows:
        half = max_rows // 2
        items = items[:half] + [None] + items[-half:]
    for item in items:
        if item is None:
            table.add_row("…", "", "")
            continue
        name, shape = item
        count = 1
        for n in shape:
            count *= n
        table.add_row(name, str(tuple(shape)), f"{count:,}")
    return table


def side_by_side(*renderables) -> Columns:
    """Renderables next to each other when the terminal is wide enough, else stacked."""
    return Columns(list(renderables), padding=(0, 3))
