"""The explorer's screen (Textual): the run's tensors on the left, the selected one as a 2-D
slice in the centre, the selected cell explained beside it (under it below 110 columns), and
the ``tfm`` command that prints the view at the bottom. What is shown is ``state``'s; this
module draws it and maps keys to moves.
"""

from __future__ import annotations

import numpy as np
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import OptionDoesNotExist

from tfmcli.render.numbers import fmt_fixed
from tfmcli.tui.state import Explorer, View

CELL = 8   # a number's column: sign, digit, point, four digits, a space
KEYS_HELP = ("arrows move · Tab pane · / filter · [ ] head · r R row · { } block · x swap · "
             "d value/grad · v numbers/colours · Enter follow · Esc back · g overview · "
             "c check · s screenshot · q quit")


def colour(value: float, scale: float) -> str:
    """Diverging, in five steps a side: red below 0, blue above (the CLI's legend)."""
    if not np.isfinite(value) or scale == 0:
        return ""
    level = min(4, int(abs(value) / scale * 5))
    reds = ("#3a1c1c", "#5c2323", "#7f2a2a", "#a33232", "#c83a3a")
    blues = ("#1c263a", "#23355c", "#2a447f", "#3253a3", "#3a62c8")
    return f"on {(blues if value > 0 else reds)[level]}"


class TensorPane(Static, can_focus=True):
    """The selected tensor's slice; arrows move its cursor."""

    BINDINGS = [Binding("up", "move(-1, 0)", show=False), Binding("down", "move(1, 0)", show=False),
                Binding("left", "move(0, -1)", show=False),
                Binding("right", "move(0, 1)", show=False)]

    def action_move(self, down: int, right: int) -> None:
        self.app.move(down, right)


class ExploreApp(App):
    """``tfm explore``: every number of one run under the keyboard."""

    TITLE = "tfm explore"
    CSS = """
    #top { height: 1; background: $primary-background; }
    #body { height: 1fr; }
    #left { width: 30; border-right: solid $primary; }
    #filter { height: 3; display: none; }
    #filter.shown { display: block; }
    #tree { height: 1fr; border: none; text-wrap: nowrap; text-overflow: ellipsis; }
    #main { width: 1fr; }
    #tensor { height: 1fr; width: 1fr; padding: 0 1; }
    #explain { width: 40; padding: 0 1; border-left: solid $primary; }
    #bottom { height: 2; background: $primary-background; }
    .narrow #explain { width: 1fr; height: 10; border-left: none; border-top: solid $primary; }
    .narrow #left { width: 22; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"), Binding("tab", "next_pane", show=False),
        Binding("slash", "filter", show=False),
        Binding("right_square_bracket", "step('H', 1)", show=False),
        Binding("left_square_bracket", "step('H', -1)", show=False),
        Binding("r", "step('B', 1)", show=False), Binding("R", "step('B', -1)", show=False),
        Binding("right_curly_bracket", "block(1)", show=False),
        Binding("left_curly_bracket", "block(-1)", show=False),
        Binding("x", "swap", show=False), Binding("d", "flip", show=False),
        Binding("v", "numbers", show=False), Binding("enter", "follow", show=False),
        Binding("escape", "back", show=False), Binding("g", "overview", show=False),
        Binding("c", "check", show=False), Binding("s", "screenshot", show=False),
        Binding("question_mark", "keys", show=False),
    ]

    def __init__(self, explorer: Explorer, header: str):
        super().__init__()
        self.explorer, self.header = explorer, header
        self.view = explorer.first_view(self.first_name())
        self.stack: list[View] = []
        self.numbers = True
        self.note = ""
        self.grid: tuple[int, int] | None = None   # the overview's (block, head), when open

    def first_name(self) -> str:
        pattern = "blocks.0.attn.pattern"
        return pattern if pattern in self.explorer.values else self.explorer.names()[0]

    def compose(self) -> ComposeResult:
        yield Static(self.header, id="top")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield Input(placeholder="filter", id="filter")
                yield OptionList(*self.tree_lines(""), id="tree")
            with Horizontal(id="main"):
                yield TensorPane(id="tensor")
                yield Static(id="explain")
        yield Static(id="bottom")

    def on_mount(self) -> None:
        tree = self.query_one("#tree", OptionList)
        tree.highlighted = tree.get_option_index(self.explorer.tree_id(self.view))
        self.query_one("#tensor").focus()
        self.on_resize()
        self.draw()
        self.call_after_refresh(self.draw)   # again, at the size the layout gave the pane

    def on_resize(self, event=None) -> None:
        narrow = self.size.width < 110
        self.screen.set_class(narrow, "narrow")
        main = self.query_one("#main", Horizontal)
        main.styles.layout = "vertical" if narrow else "horizontal"
        if event is not None:
            self.call_after_refresh(self.draw)

    # ------------------------------------------------------------ the tree

    def tree_lines(self, text: str) -> list:
        """The tree's lines as options: headings bold and not selectable, a guide for each
        level (a visible one: an SVG drops leading spaces), shapes dim and lined up."""
        from textual.widgets.option_list import Option

        lines = self.explorer.tree(text)
        width = max((2 * depth + len(label) for depth, label, _, key in lines if key), default=0)
        options = []
        for depth, label, shape, key in lines:
            line = Text("│ " * depth, style="dim", no_wrap=True, overflow="ellipsis")
            if key is None:
                line.append(label, style="bold")
                options.append(Option(line, disabled=True))
                continue
            line.append(label.ljust(width - 2 * depth + 1))
            line.append(shape, style="dim")
            options.append(Option(line, id=key))
        return options or [Option("(no tensor matches)", disabled=True)]

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        key = event.option.id
        if self.focused is event.option_list and key and key != self.explorer.tree_id(self.view):
            grad, name = key.startswith("g:"), key[2:]
            self.open(self.explorer.first_view(name, grad))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.query_one("#tensor").focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        tree = self.query_one("#tree", OptionList)
        tree.clear_options()
        tree.add_options(self.tree_lines(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#tree").focus()

    # ------------------------------------------------------------ moving

    def open(self, view: View, remember: bool = False) -> None:
        if remember:
            self.stack.append(self.view)
        self.view, self.note, self.grid = view, "", None
        self.draw()

    def move(self, down: int, right: int) -> None:
        if self.grid is not None:
            layers, heads = self.explorer.cfg.layers, self.explorer.cfg.heads
            self.grid = ((self.grid[0] + down) % layers, (self.grid[1] + right) % heads)
            self.draw()
            return
        self.open(self.explorer.move(self.view, down, right))

    def action_step(self, kind: str, step: int) -> None:
        self.open(self.explorer.step(self.view, kind, step))

    def action_block(self, step: int) -> None:
        self.open(self.explorer.block(self.view, step))

    def action_swap(self) -> None:
        self.open(self.explorer.swap(self.view))

    def action_flip(self) -> None:
        self.open(self.explorer.flip(self.view))

    def action_numbers(self) -> None:
        self.numbers = not self.numbers
        self.draw()

    def action_follow(self) -> None:
        if self.focused is self.query_one("#tree"):
            self.query_one("#tensor").focus()
            return
        if self.grid is not None:
            block, head = self.grid
            name = f"blocks.{block}.attn.pattern"
            view = self.explorer.first_view(name)
            self.open(View(name, False, view.shown, (self.view.index[0] if self.view.index
                                                     else 0, head, 0, 0)), remember=True)
            return
        target = self.explorer.follow(self.view)
        if target is None:
            self.note = "this cell has no one input to follow"
            self.draw()
        else:
            self.open(target, remember=True)

    def action_back(self) -> None:
        if self.grid is not None:
            self.grid = None
            self.draw()
        elif self.stack:
            self.view = self.stack.pop()
            self.draw()

    def action_next_pane(self) -> None:
        tree, tensor = self.query_one("#tree"), self.query_one("#tensor")
        (tensor if self.focused is tree else tree).focus()

    def action_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.add_class("shown")
        field.focus()

    def action_overview(self) -> None:
        self.grid = (0, 0)
        self.draw()

    def action_check(self) -> None:
        view = self.view
        if not (view.grad and self.explorer.is_param(view.name)):
            self.note = "c checks a parameter's gradient entry: d on a parameter first"
        else:
            ours, numeric = self.explorer.central_difference(view)
            self.note = (f"backward {ours:+.9e}\ncentral difference {numeric:+.9e}\n"
                         f"|difference| {abs(ours - numeric):.2e}")
        self.draw()

    def action_screenshot(self) -> None:
        from tfmcli.io import save_outputs

        save_outputs(text_path="tfm-explore.svg", text=self.svg())
        self.note = "saved tfm-explore.svg"
        self.draw()

    def svg(self) -> str:
        """The screen as SVG, its spaces kept in every renderer (librsvg drops a line's
        leading spaces without xml:space="preserve", as tfm's other pictures carry)."""
        return self.export_screenshot().replace(
            '<svg class="rich-terminal" ', '<svg class="rich-terminal" xml:space="preserve" ', 1)

    def action_keys(self) -> None:
        self.note = KEYS_HELP
        self.draw()

    # ------------------------------------------------------------ drawing

    def draw(self) -> None:
        tensor, explain = self.query_one("#tensor", Static), self.query_one("#explain", Static)
        bottom = self.query_one("#bottom", Static)
        if self.grid is not None:
            tensor.update(self.overview())
            block, head = self.grid
            explain.update(f"blocks.{block}.attn.pattern, head {head}\n"
                           "brighter: more weight (a cell shows the\nlargest of the weights it "
                           "covers)\nEnter: open it · Esc: back")
            bottom.update(f"$ tfm forward {' '.join(self.explorer.argv)} --full".replace("  ", " ")
                          + "\nEnter open · Esc back · q quit")
            return
        tree = self.query_one("#tree", OptionList)
        if self.focused is not tree:
            try:
                tree.highlighted = tree.get_option_index(self.explorer.tree_id(self.view))
            except OptionDoesNotExist:   # filtered out of the list
                pass
        tensor.update(self.slice_table())
        lines = self.explorer.explain(self.view)
        explain.update("\n".join(lines + ([""] + self.note.split("\n") if self.note else [])))
        bottom.update(f"$ {self.explorer.command(self.view)}\n"
                      "Esc back · ? keys · s screenshot · q quit")

    def slice_table(self):
        """The slice around the cursor, as many cells as the pane holds; the labels and
        numbers of those cells only (a vocabulary axis has 50,257)."""
        ex, view = self.explorer, self.view
        matrix = ex.matrix(view)
        hidden = ex.hidden(view)
        rows_axis, cols_axis = view.shown
        one_d = ex.array(view).ndim == 1
        n_rows, n_cols = matrix.shape
        at_row = 0 if one_d else view.index[rows_axis]
        at_col = view.index[0] if one_d else view.index[cols_axis]
        pane = self.query_one("#tensor")
        width = max(20, pane.size.width or 60)
        fit_rows = max(1, (pane.size.height or 12) - 5)
        r0 = min(max(0, at_row - fit_rows // 2), max(0, n_rows - fit_rows))
        row_labels = [""] if one_d else ex.labels(view, rows_axis, r0, r0 + fit_rows)
        label_width = min(12, max(map(len, row_labels)) + 1)
        fit_cols = max(1, (width - label_width - 2) // CELL)
        c0 = min(max(0, at_col - fit_cols // 2), max(0, n_cols - fit_cols))
        col_labels = ex.labels(view, 0 if one_d else cols_axis, c0, c0 + fit_cols)
        scale = ex.scale(view)
        axes = ex.axes(view.name)
        fixed = [f"{axes[a]} {view.index[a]}" for a in range(len(axes))
                 if a not in view.shown or one_d and a != 0]
        title = (f"{'d' if view.grad else ''}{view.name} ({', '.join(axes)}) "
                 f"{'x'.join(map(str, ex.array(view).shape))}"
                 + (f"  · {' · '.join(fixed)}" if fixed else ""))
        table = Table(title=title, title_justify="left", box=None, padding=(0, 0),
                      show_edge=False, pad_edge=False)
        table.add_column("", width=label_width, no_wrap=True)
        for label in col_labels:
            table.add_column(label[:CELL - 1], width=CELL, justify="right", no_wrap=True)
        for r, label in enumerate(row_labels, start=r0):
            cells = []
            for c in range(c0, c0 + len(col_labels)):
                value = float(matrix[r, c])
                if hidden is not None and hidden[r, c]:
                    text = Text("·", style="dim")
                else:
                    shown = fmt_fixed(value, 4) if self.numbers else ""   # ≈0, not -0.0000
                    if abs(value) >= 100 and self.numbers:
                        shown = f"{value:+.1e}"
                    text = Text(shown, style=colour(value, scale))
                if r == at_row and c == at_col:
                    text.stylize("reverse")
                cells.append(text)
            table.add_row(label[:label_width - 1], *cells)
        legend = Text(f"red < 0 < blue, darkest at |x| {scale:.3g}"
                      + (" · masked" if hidden is not None else ""), style="dim")
        from rich.console import Group
        return Group(table, legend)

    def overview(self):
        """Every block's every head's attention pattern of the row, small, in a grid: as many
        as the pane holds around the one chosen, each map pooled to at most 8 x 8 (a cell
        shows the largest weight it covers, so a sharp head stays sharp)."""
        ex, cfg = self.explorer, self.explorer.cfg
        row = self.view.index[0] if ex.axes(self.view.name)[0] == "B" else 0
        pane = self.query_one("#tensor")
        width, height = max(20, pane.size.width or 60), max(8, pane.size.height or 20)
        T = ex.values["blocks.0.attn.pattern"].shape[-1]
        size = min(T, 8)
        across = max(1, min(cfg.heads, (width - 6) // (size + 1)))
        down = max(1, min(cfg.layers, (height - 4) // (size + 1)))
        block, head = self.grid
        h0 = min(max(0, head - across // 2), cfg.heads - across)
        b0 = min(max(0, block - down // 2), cfg.layers - down)
        blues = ("#000000", "#1c263a", "#23355c", "#2a447f", "#3253a3", "#3a62c8")
        chunks = np.array_split(np.arange(T), size)
        grid = Table(title=f"attention, row {row}: blocks {b0}-{b0 + down - 1} of "
                     f"{cfg.layers} down, heads {h0}-{h0 + across - 1} of {cfg.heads} across",
                     title_justify="left", box=None,
                     padding=(0, 1, 0, 0))
        grid.add_column("", no_wrap=True)
        for h in range(h0, h0 + across):
            grid.add_column(Text(f">h{h}" if h == head else f"h{h}",
                                 style="bold reverse" if h == head else ""), no_wrap=True)
        for b in range(b0, b0 + down):
            pattern = ex.values[f"blocks.{b}.attn.pattern"][row]
            cells = [Text(f">b{b}" if b == block else f"b{b}",
                          style="bold reverse" if b == block else "")]
            for h in range(h0, h0 + across):
                lines = []
                for qs in chunks:
                    line = Text()
                    for ks in chunks:
                        level = min(5, int(np.ceil(pattern[h][np.ix_(qs, ks)].max() * 5)))
                        line.append("\u2588" if level == 5 else " ", style=f"on {blues[level]}")
                    lines.append(line)
                cells.append(Text("\n").join(lines))
            grid.add_row(*cells)
        return grid
