"""The logit lens as a table: rows are layers, columns positions, cells the top tokens."""

from __future__ import annotations

from rich.text import Text

from tfmcli.render.tables import ELLIPSIS, _kept, _table


def _cell_lines(cell) -> list[str]:
    return [f"{token} {p:.2f}" for token, p in cell]


def lens_table(layers, tokens, targets, grid, *, width: int = 80, full: bool = False):
    """``grid[layer][position]`` is a list of (token text, probability), most likely first.

    Column headers are the input tokens (``2:␣sat``) with the target under them
    (``→␣on``); a cell whose first token is the target is green. Positions that do not fit
    ``width`` are elided from the middle, NumPy-style, with a note (``full`` keeps them).
    """
    T = len(tokens)
    headers = [f"{t}:{tok}\n→{target}" for t, (tok, target) in enumerate(zip(tokens, targets))]
    widths = [
        max(
            len(line)
            for cell in ([headers[t].split("\n")] + [_cell_lines(g[t]) for g in grid])
            for line in cell
        )
        for t in range(T)
    ]
    label_width = max(len(name) for name in layers)
    budget = T
    if not full:
        while budget > 2:
            kept = _kept(T, budget, False)
            used = label_width + 1 + sum((1 if t is None else widths[t]) + 2 for t in kept)
            if used <= width:
                break
            budget -= 1
    kept = _kept(T, budget, full)
    table = _table(caption=(f"showing {len(kept) - 1} of {T} positions; --full shows all"
                            if None in kept else None))
    table.padding = (0, 0, 0, 1)   # with the column divider: two spaces between positions
    table.add_column("", style="dim", justify="right", no_wrap=True)
    for t in kept:
        table.add_column(ELLIPSIS if t is None else headers[t], justify="left", no_wrap=True,
                         width=1 if t is None else widths[t])
    for name, row in zip(layers, grid):
        cells = []
        for t in kept:
            if t is None:
                cells.append(Text(ELLIPSIS, style="dim"))
                continue
            hit = row[t] and row[t][0][0] == targets[t]
            cell = Text()
            for i, line in enumerate(_cell_lines(row[t])):
                cell.append(("\n" if i else "") + line,
                            style="bold green" if hit and i == 0 else ("" if i == 0 else "dim"))
            cells.append(cell)
        table.add_row(name, *cells)
    return table
