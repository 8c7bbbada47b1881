"""``--help``'s option tables fitted to the terminal.

Typer lays out an option as six cells side by side: its long name, its short one, the long
and short names of its ``--no-`` form, its type and its help. The model commands take every
Config field, and their longest names (``--parallel-residual`` beside
``--no-parallel-residual``, ``--rope-scaling`` beside ``32,1,4,8192``) left the help 19 columns
at 80: ``tfm forward --help`` ran to 348 lines, most of them one or two words long. Here the
names share one cell, ``--batch, -B``, and a switch's two forms are written as git writes them,
``--[no-]causal``, so that each option of the architecture panel takes one line.

Two panels are drawn two or three to a line, so that a model command's help, which lists
some sixty options, fits 80 lines at 80 columns: the sizes (``--batch, -B  Batch rows B (2)``,
each help a few words with its default), and the architecture's on/off switches
(``--[no-]causal``, fourteen of them), by name only, the panel's title naming those that are
on (what each does: docs/architectures.md).

Typer builds the table inside ``typer.rich_utils._print_options_panel`` (the same six cells
in every release tfm allows: 0.26-0.28). The table's class is swapped, when help is about to
be drawn, for one that joins the name cells as each row is added; the commands panel (two
cells a row) and every other table are left as they are. The sizes and the switches are
drawn here.
"""

from __future__ import annotations

from typer.core import TyperCommand

# --help's panels, in the order a learner reaches for them (a command's own options come first)
INPUT = "Input"
OUTPUT = "Output"
INTERVENE = "Interventions (docs/interventions.md)"
SIZES = "Sizes"
ARCH = "Architecture (every flag explained: docs/architectures.md)"
SWITCHES = "Architecture switches"   # (its title says which are on)
PANELS = (INPUT, OUTPUT, INTERVENE, SIZES, ARCH, SWITCHES)

NAME_CELLS = 4   # long, short, --no- long, --no- short
OPTION_CELLS = NAME_CELLS + 2   # then the type and the help


def fit_options_tables() -> None:
    """From now on, --help's option tables put each option's names in one cell."""
    from typer import rich_utils

    if getattr(rich_utils.Table, "joins_names", False):
        return
    rich_utils.Table = _table_joining_names(rich_utils.Table)
    rich_utils._print_options_panel = _switches_side_by_side(rich_utils._print_options_panel)


def _switches_side_by_side(print_panel):
    """Typer's panel printer, but for the sizes (two to a line) and the switches (their
    names in columns)."""
    from rich.columns import Columns
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
    from typer import rich_utils

    def print_options_panel(*, name, params, ctx, markup_mode, console):
        style = rich_utils.STYLE_OPTION
        if name == SIZES:   # two to a line where they fit, else one
            body, title = sizes_grid(params, style, two=True), name
            if console.measure(body).maximum > console.width - 4:   # (the panel's edges)
                body = sizes_grid(params, style, two=False)
        elif name == SWITCHES:
            body = Columns([Text(switch_name(param.opts[0], param.secondary_opts[0]),
                                 style=style) for param in params],
                           column_first=True, padding=(0, 2))
            on = [param.opts[0].removeprefix("--") for param in params if param.default is True]
            title = f"{name} (on by default: {', '.join(on)})" if on else name
        else:
            return print_panel(name=name, params=params, ctx=ctx, markup_mode=markup_mode,
                               console=console)
        console.print(Panel(body, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
                            title=title, title_align=rich_utils.ALIGN_OPTIONS_PANEL))

    def sizes_grid(params, style, two: bool):
        grid = Table.grid(padding=(0, 2))
        half = (len(params) + 1) // 2 if two else len(params)
        for left, right in zip(params[:half], [*params[half:], None] if two else params):
            grid.add_row(*size_cells(left, style), *(size_cells(right, style) if two else ()))
        return grid

    def size_cells(param, style):
        """``--batch, -B`` and ``Batch rows B (2)``; ``--lengths 4,2`` and its help."""
        if param is None:
            return Text(""), Text("")
        named = ", ".join(param.opts) + (f" {param.metavar}" if param.metavar else "")
        default = f" ({param.default})" if param.default is not None else ""
        return Text(named, style=style), Text(param.help + default)

    return print_options_panel


def switch_name(on: str, off: str) -> str:
    """``--[no-]causal`` or ``--[un]tied-head`` (git's way of writing both forms); another pair
    as click writes it, ``--rms-norm/--layer-norm``."""
    for prefix in ("no-", "un"):
        if off == "--" + prefix + on[2:]:
            return f"--[{prefix}]{on[2:]}"
    return f"{on}/{off}"


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
            joined = switch_name(long.plain, no_long.plain)   # --[no-]causal, or the pair
            if joined.startswith("--["):
                prefix = joined[2:joined.index("]") + 1]
                return Text.assemble(("--", long.style), (prefix, no_long.style),
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
