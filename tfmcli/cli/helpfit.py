"""``--help``'s option tables fitted to the terminal.

Typer lays out an option as six cells side by side: its long name, its short one, the long
and short names of its ``--no-`` form, its type and its help. The model commands take every
Config field, and their longest names (``--parallel-residual`` beside
``--no-parallel-residual``, ``--rope-scaling`` beside ``32,1,4,8192``) left the help 19 columns
at 80: ``tfm forward --help`` ran to 348 lines, most of them one or two words long. Here the
names share one cell, ``--batch, -B``, and a switch's two forms are written as git writes them,
``--[no-]causal``, so that each option of the architecture panel takes one line.

Typer builds the table inside ``typer.rich_utils._print_options_panel`` (the same six cells
in every release tfm allows: 0.26-0.28). The table's class is swapped, when help is about to
be drawn, for one that joins the name cells as each row is added; the commands panel (two
cells a row) and every other table are left as they are.
"""

from __future__ import annotations

from typer.core import TyperCommand

NAME_CELLS = 4   # long, short, --no- long, --no- short
OPTION_CELLS = NAME_CELLS + 2   # then the type and the help


def fit_options_tables() -> None:
    """From now on, --help's option tables put each option's names in one cell."""
    from typer import rich_utils

    if getattr(rich_utils.Table, "joins_names", False):
        return
    rich_utils.Table = _table_joining_names(rich_utils.Table)


def _table_joining_names(table):
    from rich.text import Text

    class OptionsTable(table):
        """A rich Table whose rows of an option (six cells, after a required mark or not) come
        out as the names in one cell, the type and the help."""

        joins_names = True

        def add_row(self, *cells, **options):
            if len(cells) in (OPTION_CELLS, OPTION_CELLS + 1) and all(
                    isinstance(cell, Text) for cell in cells[-OPTION_CELLS:-1]):
                mark, row = cells[:-OPTION_CELLS], cells[-OPTION_CELLS:]
                cells = (*mark, names(*row[:NAME_CELLS]), *row[NAME_CELLS:])
            return super().add_row(*cells, **options)

    def names(long, short, no_long, no_short):
        """``--batch, -B``; a switch as ``--[no-]causal`` (git's way of writing both forms) or
        ``--[un]tied-head``; another pair as click writes it, ``--rms-norm/--layer-norm``."""
        if not short.plain and not no_short.plain and long.plain.startswith("--"):
            for prefix in ("no-", "un"):
                if no_long.plain == "--" + prefix + long.plain[2:]:
                    return Text.assemble(("--", long.style), (f"[{prefix}]", no_long.style),
                                         (long.plain[2:], long.style))
        forms = [Text(", ").join(name for name in pair if name.plain)
                 for pair in ((long, short), (no_long, no_short))]
        return Text("/").join(form for form in forms if form.plain)

    return OptionsTable


class FittedHelpCommand(TyperCommand):
    """A tfm command, whose --help fits its option tables first (``fit_options_tables``)."""

    def format_help(self, ctx, formatter):
        fit_options_tables()
        return super().format_help(ctx, formatter)
