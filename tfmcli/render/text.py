"""What a view is as plain text: ``print(tfmcli.render.heatmap(...))`` in a notebook prints
the view, as the command line would with its output piped, not ``<rich.constrain.Constrain
object ...>``."""

from __future__ import annotations

import io

WIDTH = 100   # a notebook's cell output has no terminal to measure


class Printable:
    """A mix-in for the views' renderables: ``str()`` is the view in plain text."""

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(file=io.StringIO(), width=WIDTH, color_system=None,
                          force_terminal=False, highlight=False)
        console.print(self)
        return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())
