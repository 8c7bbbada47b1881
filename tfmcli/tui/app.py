"""The explorer's screen (Textual): the run's tensors on the left, the selected one as a 2-D
slice in the centre, the selected cell explained beside it (under it below 110 columns), and
the ``tfm`` command that prints the view at the bottom. What is shown is ``state``'s; this
module draws it and maps keys to moves. At 80x24 first: the explanation scrolls, ``?`` lists
every key (read from the bindings), each column of numbers is written at its own scale
(``render.numbers.column``) and what does not fit is said ("rows 0-6 of 50257").
"""

from __future__ import annotations

import math

import numpy as np
from rich.cells import cell_len
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.keys import key_to_character
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option, OptionDoesNotExist

from tfmcli.render.numbers import column
from tfmcli.tui.state import CIRCUIT, Explorer, View

LABEL = 12      # a row label's widest
HEADER = 9      # a column label's widest
NARROW = 110    # below this many columns the explanation goes under the tensor
ZERO = "on #303030"   # an exact zero's cell: neither the negatives' red nor the positives' blue
KEY_NAMES = {"up": "↑", "down": "↓", "left": "←", "right": "→", "enter": "Enter",
             "escape": "Esc", "tab": "Tab", "slash": "/", "pageup": "PgUp", "pagedown": "PgDn",
             "home": "Home", "end": "End"}


def colour(value: float, scale: float) -> str:
    """Diverging, in five steps a side: red below 0, blue above (the CLI's legend); an exact
    zero grey."""
    if not np.isfinite(value) or scale == 0:
        return ""
    if value == 0:
        return ZERO
    level = min(4, int(abs(value) / scale * 5))
    reds = ("#3a1c1c", "#5c2323", "#7f2a2a", "#a33232", "#c83a3a")
    blues = ("#1c263a", "#23355c", "#2a447f", "#3253a3", "#3a62c8")
    return f"on {(blues if value > 0 else reds)[level]}"


class TensorPane(Static, can_focus=True):
    """The selected tensor's slice; arrows move its cursor."""

    BINDINGS = [Binding(key, f"move({down}, {right})", "move the cell (in the list: the tensor)")
                for key, down, right in (("up", -1, 0), ("down", 1, 0), ("left", 0, -1),
                                         ("right", 0, 1))]

    def action_move(self, down: int, right: int) -> None:
        self.app.move(down, right)

    def on_resize(self) -> None:   # the slice shown is as big as the pane: drawn again
        self.app.call_after_refresh(self.app.draw)


class ExplainPane(VerticalScroll, can_focus=True, inherit_bindings=False):
    """The cell explained, as long as it is: it scrolls (PgUp/PgDn from the tensor; with the
    focus, Tab to it, the arrows too)."""

    BINDINGS = [Binding(key, f"scroll_{to}", "scroll the explanation, once Tab has focused it")
                for key, to in (("up", "up"), ("down", "down"), ("home", "home"), ("end", "end"))]


class KeysScreen(ModalScreen):
    """``?``: every key of the explorer, read from the bindings themselves. On a screen too
    small for the list, the arrows and PgUp/PgDn scroll it; any other key closes it."""

    SCROLL = {"up": "scroll_up", "down": "scroll_down", "pageup": "scroll_page_up",
              "pagedown": "scroll_page_down", "home": "scroll_home", "end": "scroll_end"}

    CSS = """
    KeysScreen { align: center middle; }
    #keys { width: auto; max-width: 100%; height: auto; max-height: 100%;
            border: round $primary; padding: 0 1; background: $surface; }
    #keys Static { width: auto; max-width: 100%; }
    """

    def __init__(self, lines: list[tuple[str, str]]):
        super().__init__()
        self.lines = lines

    def compose(self) -> ComposeResult:
        width = max(cell_len(keys) for keys, _ in self.lines) + 2
        text = Text("tfm explore's keys (any key closes this)\n", style="bold")
        for keys, does in self.lines:
            text.append(keys.ljust(width), style="bold")
            text.append(does + "\n")
        text.rstrip()
        with VerticalScroll(id="keys"):
            yield Static(text)

    def on_key(self, event) -> None:
        if event.key == "q":
            return   # q still quits, from the app's bindings
        event.stop()
        if event.key in self.SCROLL:
            getattr(self.query_one("#keys"), self.SCROLL[event.key])(animate=False)
        else:
            self.dismiss()


class EndsScreen(ModalScreen):
    """Enter on an edge of the circuit: its two ends, the sender's and the reader's, to
    choose from (↑ ↓, Enter opens; 1 or 2 opens that one; Esc stays on the edge). Dismissed
    with the index of the end chosen, or None."""

    CSS = """
    EndsScreen { align: center middle; }
    #ends { width: auto; max-width: 100%; height: auto; max-height: 100%;
            border: round $primary; padding: 0 1; background: $surface; }
    """

    def __init__(self, edge: str, ends: list[tuple[str, str]]):
        super().__init__()
        self.edge, self.ends, self.at = edge, ends, 0

    def compose(self) -> ComposeResult:
        yield Static(self.text(), id="ends")

    def text(self) -> Text:
        text = Text(f"follow {self.edge} to\n", style="bold")
        for k, (what, where) in enumerate(self.ends):
            line = Text(f"{k + 1} {what}", style="reverse" if k == self.at else "")
            text.append_text(line)
            text.append(f"\n    {where}\n")
        text.append("↑ ↓ Enter or 1 2: open · Esc: stay", style="dim")
        return text

    def on_key(self, event) -> None:
        if event.key == "q":
            return   # q still quits, from the app's bindings
        event.stop()
        if event.key in ("up", "down"):
            self.at = (self.at + (1 if event.key == "down" else -1)) % len(self.ends)
            self.query_one("#ends", Static).update(self.text())
        elif event.key == "enter":
            self.dismiss(self.at)
        elif event.key in ("1", "2"):
            self.dismiss(int(event.key) - 1)
        elif event.key == "escape":
            self.dismiss(None)


OPERATORS = ("=", "x", "+", "-", "/", "*")


def words(text: str, before: bool = True) -> list[str]:
    """``text`` split at its spaces outside brackets (``resid1[0, 2]`` and ``(x - mean)`` are
    one word each), an operator kept with the word after it (``+ 0.1234``), ``=`` and ``x``
    with the word before too (``W[0, 2] = 0.5``, ``+0.2776 x 0.9877``), a short bracket with
    the word before (``act (mean):``), unless not ``before``. Joined by spaces, they are
    ``text``."""
    parts, depth, part = [], 0, ""
    for ch in text:
        if ch == " " and depth == 0:
            parts.append(part)
            part = ""
            continue
        depth = max(0, depth + (ch in "([") - (ch in ")]"))
        part += ch
    parts.append(part)
    joined: list[str] = []
    for part in parts:
        glued = joined and joined[-1] and (
            joined[-1].rsplit(" ", 1)[-1] in OPERATORS or before and (
                part in ("=", "x") or part.startswith("(") and len(part) <= 8))
        if glued:
            joined[-1] += " " + part
        else:
            joined.append(part)
    return joined


def fold(line: str, width: int, under: str | None = None) -> list[str]:
    """An explanation's line wider than the pane, folded at its spaces (``words``) rather
    than cut wherever the pane ends, inside a number or a bracket; after a comma, semicolon
    or colon when one is past the line's first third (``the formula gives -1.066e-04,``); the
    lines after the first indented two more than it (``under``)."""
    if cell_len(line) <= width:
        return [line]
    body = line.lstrip(" ")
    indent = line[:len(line) - len(body)]
    under = indent + "  " if under is None else under
    parts = words(body)
    if cell_len(indent + parts[0]) > width:   # too wide kept together: apart, then
        parts = [*words(parts[0], before=False), *parts[1:]]
    if len(parts) == 1 and body[0] in "([":   # one bracket, the whole line: fold inside it
        parts = words(body[1:])
        parts[0] = body[0] + parts[0]
    fit = 1   # the most words that fit (at least one: a word wider than the pane stays whole)
    while fit < len(parts) and cell_len(indent + " ".join(parts[:fit + 1])) <= width:
        fit += 1
    if fit == len(parts):
        return [line]
    cut = next((k for k in range(fit, 1, -1) if parts[k - 1].endswith((",", ";", ":"))
                and cell_len(indent + " ".join(parts[:k])) >= width // 3), fit)
    return [(indent + " ".join(parts[:cut])).rstrip(),
            *fold(under + " ".join(parts[cut:]).lstrip(" "), width, under)]


def key_name(key: str) -> str:
    """How a binding's key is written on screen: ↑, Esc, PgDn, ], ?."""
    return KEY_NAMES.get(key) or key_to_character(key) or key


class ExploreApp(App):
    """``tfm explore``: every number of one run under the keyboard."""

    TITLE = "tfm explore"
    CSS = """
    #top { height: 1; background: $primary-background; text-wrap: nowrap;
           text-overflow: ellipsis; }
    #body { height: 1fr; }
    #left { width: 30; border-right: solid $primary; }
    #filter { height: 3; display: none; }
    #filter.shown { display: block; }
    #tree { height: 1fr; border: none; text-wrap: nowrap; text-overflow: ellipsis;
            scrollbar-size-vertical: 1; }
    #main { width: 1fr; }
    #tensor { height: 1fr; width: 1fr; padding: 0 1; }
    #explain { width: 40; padding: 0 1; border-left: solid $primary;
               scrollbar-size-vertical: 1; }
    #explain:focus { border-left: heavy $accent; }
    #bottom { height: auto; max-height: 4; background: $primary-background; }
    .narrow #explain { width: 1fr; height: 10; max-height: 50%; border-left: none;
                       border-top: solid $primary; }
    .narrow #explain:focus { border-top: heavy $accent; }
    .narrow #left { width: 24; }
    """
    BINDINGS = [
        Binding("tab", "next_pane", "the next pane: the list, the explanation, the tensor",
                priority=True),   # before the screen's own Tab (the focus chain's order)
        Binding("slash", "filter", "filter the list; Enter opens the match, Esc clears it"),
        Binding("left_square_bracket", "step('H', -1)", "previous / next head"),
        Binding("right_square_bracket", "step('H', 1)", "previous / next head"),
        Binding("r", "step('B', 1)", "next / previous batch row"),
        Binding("R", "step('B', -1)", "next / previous batch row"),
        Binding("left_curly_bracket", "block(-1)", "the same tensor in the previous / next block"),
        Binding("right_curly_bracket", "block(1)", "the same tensor in the previous / next block"),
        Binding("x", "swap", "swap the two axes shown"),
        Binding("d", "flip", "the tensor <-> its gradient"),
        Binding("v", "numbers", "numbers <-> colours only"),
        Binding("enter", "follow", "follow the cell to what it came from (an edge: its ends)"),
        Binding("escape", "back", "back (the views followed are a stack)"),
        Binding("g", "overview", "every block's heads' patterns, small; Enter opens one"),
        Binding("c", "check", "check a parameter's gradient by central differences"),
        Binding("p", "precision", "each cell's difference from float64 (--dtype runs)"),
        Binding("pagedown", "scroll_explanation(1)", "scroll the explanation down / up"),
        Binding("pageup", "scroll_explanation(-1)", "scroll the explanation down / up"),
        Binding("s", "screenshot", "save the screen as tfm-explore.svg"),
        Binding("question_mark", "keys", "these keys"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, explorer: Explorer, header: str):
        super().__init__()
        self.explorer, self.header = explorer, header
        self.view = explorer.first_view(self.first_name())
        self.stack: list[View] = []
        self.numbers = True
        self.note = ""
        self.narrow = False
        self.grid: tuple[int, int, int] | None = None   # the overview's (row, block, head)
        self._writers: dict = {}   # a slice's column -> how it is written, and its width
        self._floor: float | None = None

    def first_name(self) -> str:
        if self.explorer.circuit is not None:   # opened with a corrupted run: its circuit
            return CIRCUIT
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
                with ExplainPane(id="explain"):
                    yield Static(id="explanation")
        yield Static(id="bottom")

    def on_mount(self) -> None:
        self.highlight()
        self.query_one("#tensor").focus()
        self.on_resize()
        self.draw()
        self.call_after_refresh(self.draw)   # again, at the size the layout gave the pane

    def on_resize(self, event=None) -> None:
        narrow = self.size.width < NARROW
        self.screen.set_class(narrow, "narrow")
        main = self.query_one("#main", Horizontal)
        main.styles.layout = "vertical" if narrow else "horizontal"
        if narrow != self.narrow:   # the list drops its shapes when narrow: names first
            self.narrow = narrow
            self.refill(self.query_one("#filter", Input).value)
        if event is not None:
            self.call_after_refresh(self.draw)

    @classmethod
    def keys(cls) -> list[tuple[str, str]]:
        """Every binding as (its keys, what it does), read from the bindings themselves, so
        the list cannot go stale: the tensor's arrows, the app's keys, the explanation's;
        bindings that say the same are one line (``[ ]``)."""
        lines: dict[str, list[str]] = {}
        for binding in [*TensorPane.BINDINGS, *cls.BINDINGS, *ExplainPane.BINDINGS]:
            lines.setdefault(binding.description, []).append(key_name(binding.key))
        return [(" ".join(keys), does) for does, keys in lines.items()]

    # ------------------------------------------------------------ the tree

    def tree_lines(self, text: str) -> list:
        """The tree's lines as options: headings bold and not selectable, a guide for each
        level (a visible one: an SVG drops leading spaces), shapes dim and lined up (left out
        when narrow: the names come first, and the tensor's title has its shape)."""
        lines = self.explorer.tree(text)
        width = max((2 * depth + len(label) for depth, label, _, key in lines if key), default=0)
        options = []
        for depth, label, shape, key in lines:
            line = Text("│ " * depth, style="dim", no_wrap=True, overflow="ellipsis")
            if key is None:
                line.append(label, style="bold")
                options.append(Option(line, disabled=True))
                continue
            if self.narrow:
                line.append(label)
            else:
                line.append(label.ljust(width - 2 * depth + 1))
                line.append(shape, style="dim")
            options.append(Option(line, id=key))
        return options or [Option("(no tensor matches)", disabled=True)]

    def refill(self, text: str) -> None:
        tree = self.query_one("#tree", OptionList)
        tree.clear_options()
        tree.add_options(self.tree_lines(text))
        self.highlight()

    def highlight(self) -> None:
        """The list's selection on the tensor shown (unless filtered out of it)."""
        tree = self.query_one("#tree", OptionList)
        try:
            tree.highlighted = tree.get_option_index(self.explorer.tree_id(self.view))
        except OptionDoesNotExist:
            pass

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        key = event.option.id
        if self.focused is event.option_list and key and key != self.explorer.tree_id(self.view):
            self.open_tree(key)

    def open_tree(self, key: str) -> None:
        grad, name = key.startswith("g:"), key[2:]
        self.open(self.explorer.first_view(name, grad))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.query_one("#tensor").focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.refill(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the filter opens its match: the one selected, else the first."""
        tree = self.query_one("#tree", OptionList)
        keys = [tree.get_option_at_index(i).id for i in range(tree.option_count)]
        keys = [key for key in keys if key]
        if not keys:
            return
        chosen = tree.highlighted
        key = tree.get_option_at_index(chosen).id if chosen is not None else None
        self.open_tree(key or keys[0])
        self.highlight()
        self.query_one("#tensor").focus()

    # ------------------------------------------------------------ moving

    def open(self, view: View, remember: bool = False) -> None:
        if remember:
            self.stack.append(self.view)
        self.view, self.note, self.grid = view, "", None
        self.draw()
        self.top()

    def move(self, down: int, right: int) -> None:
        if self.grid is not None:
            row, block, head = self.grid
            layers, heads = self.explorer.cfg.layers, self.explorer.cfg.heads
            self.grid = (row, (block + down) % layers, (head + right) % heads)
            self.draw()
            return
        self.open(self.explorer.move(self.view, down, right))

    def action_step(self, kind: str, step: int) -> None:
        if self.grid is not None:   # the overview's row or head
            row, block, head = self.grid
            batch, heads = self.explorer.cfg.batch, self.explorer.cfg.heads
            self.grid = ((row + step) % batch, block, head) if kind == "B" else (
                row, block, (head + step) % heads)
            self.draw()
            return
        self.open(self.explorer.step(self.view, kind, step))

    def action_block(self, step: int) -> None:
        if self.grid is not None:
            self.move(step, 0)
            return
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
            self.open(self.explorer.pattern_view(*self.grid), remember=True)
            return
        if self.view.name == CIRCUIT:
            self.follow_edge()
            return
        target = self.explorer.follow(self.view)
        if target is None:
            self.note = "this cell has no one input to follow"
            self.draw()
            self.top()
        else:
            self.open(target, remember=True)

    def follow_edge(self) -> None:
        """Enter on an edge: a choice of its two ends (``EndsScreen``); the one chosen opens,
        and Esc comes back to the edge."""
        ends = self.explorer.ends(self.view)
        if ends is None:
            self.note = "no edge here: nothing to follow"
            self.draw()
            self.top()
            return
        ex = self.explorer
        listed = [(f"{kind}'s end, {end.what}",   # blocks.0.attn.context[0, t2, 4]
                   f"{end.name}[{ex.indices(view)}]")
                  for kind, (end, view) in zip(("the sender", "the reader"), ends)]

        def chosen(at: int | None) -> None:
            if at is not None:
                self.open(ends[at][1], remember=True)

        self.push_screen(EndsScreen(ex.where(self.view), listed), chosen)

    def action_back(self) -> None:
        """Esc: the filter closed (when typing in it), the overview closed, the view before,
        or, with nothing else to undo, the filter cleared."""
        field = self.query_one("#filter", Input)
        if self.focused is not field and self.grid is not None:
            self.grid = None
            self.draw()
        elif self.focused is not field and self.stack:
            self.view = self.stack.pop()
            self.draw()
            self.top()
        elif field.has_class("shown"):
            field.value = ""
            field.remove_class("shown")
            self.refill("")
            self.query_one("#tensor").focus()

    def action_next_pane(self) -> None:
        if isinstance(self.screen, (KeysScreen, EndsScreen)):   # a priority key: it closes them
            self.screen.dismiss(None)
            return
        panes = [self.query_one(f"#{pane}") for pane in ("tensor", "tree", "explain")]
        at = panes.index(self.focused) if self.focused in panes else 0
        panes[(at + 1) % len(panes)].focus()

    def action_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.add_class("shown")
        field.focus()

    def action_overview(self) -> None:
        if "blocks.0.attn.pattern" not in self.explorer.values:
            self.note = "this run keeps no attention pattern to overview"
            self.draw()
            self.top()
            return
        self.grid = self.explorer.overview_at(self.view)
        self.draw()

    def action_check(self) -> None:
        view = self.view
        if not self.explorer.is_param(view.name) or not self.explorer.has_grad(view.name):
            self.note = "c checks a parameter's gradient entry: open a parameter first"
        else:
            ours, numeric = self.explorer.central_difference(view)
            self.note = (f"c: d loss / d {self.explorer.where(view).removeprefix('d')}\n"
                         f"backward           {ours:+.9e}\n"
                         f"central difference {numeric:+.9e}\n"
                         f"|difference|       {abs(ours - numeric):.2e}")
        self.draw()
        self.top()

    def action_precision(self) -> None:
        why = self.explorer.toggle_diff()
        self.note, self._writers = why or "", {}
        self.draw()
        self.top()

    def action_scroll_explanation(self, pages: int) -> None:
        pane = self.query_one("#explain", ExplainPane)
        (pane.scroll_page_down if pages > 0 else pane.scroll_page_up)(animate=False)

    def action_screenshot(self) -> None:
        from tfmcli.io import save_outputs

        save_outputs(text_path="tfm-explore.svg", text=self.svg())
        self.note = "saved tfm-explore.svg"
        self.draw()
        self.top()

    def svg(self) -> str:
        """The screen as SVG, its spaces kept in every renderer (librsvg drops a line's
        leading spaces without xml:space="preserve", as tfm's other pictures carry)."""
        return self.export_screenshot().replace(
            '<svg class="rich-terminal" ', '<svg class="rich-terminal" xml:space="preserve" ', 1)

    def action_keys(self) -> None:
        self.push_screen(KeysScreen(self.keys()))

    # ------------------------------------------------------------ drawing

    def top(self) -> None:
        """The explanation from its first line: a new cell, or a note (c's check) to read."""
        self.query_one("#explain", ExplainPane).scroll_home(animate=False)

    def draw(self) -> None:
        """Everything shown, from ``view`` (or the overview's ``grid``)."""
        tensor = self.query_one("#tensor", Static)
        explanation = self.query_one("#explanation", Static)
        bottom = self.query_one("#bottom", Static)
        keys = "? every key · Tab next pane · PgDn/PgUp explanation · Esc back · q quit"
        if self.grid is not None:
            tensor.update(self.overview())
            row, block, head = self.grid
            explanation.update(Text(
                f"blocks.{block}.attn.pattern, row {row}, head {head}\n"
                "brighter: more weight (a cell shows the largest of the weights it covers)\n"
                "arrows or { } [ ]: choose a block and head · r R: the row\n"
                "Enter: open it · Esc: back"))
            bottom.update(Text(f"$ tfm forward {' '.join(self.explorer.argv)} --row {row} "
                               "--full".replace("  ", " ") + "\n" + keys))
            return
        if self.focused is not self.query_one("#tree"):
            self.highlight()
        tensor.update(self.slice_table())
        lines = self.explorer.explain(self.view)
        # the answer to the key just pressed (c's check) first: never scrolled out of sight
        note = self.note.split("\n") + [""] if self.note else []
        # folded to the pane (37 columns wide, 36 beside the scrollbar of a longer text)
        pane = self.query_one("#explain").content_region
        width = max(20, pane.width or 37)
        shown = [folded for line in note + lines for folded in fold(line, width)]
        if len(shown) > pane.height:
            shown = [folded for line in note + lines for folded in fold(line, width - 1)]
        explanation.update(Text("\n".join(shown)))
        bottom.update(Text(f"$ {self.explorer.command(self.view)}\n{keys}"))

    def writer(self, matrix: np.ndarray, hidden, column_at: int):
        """How column ``column_at`` of the slice is written (``render.numbers.column``: at the
        column's scale, four significant digits, ≈0, exact zeros), and its width, worked out
        once per slice from the whole column (its masked cells left out)."""
        view = self.view
        key = (view.name, view.grad, view.shown,
               tuple(i for a, i in enumerate(view.index) if a not in view.shown), column_at)
        if key not in self._writers:
            values = matrix[:, column_at]
            if hidden is not None:
                values = values[~hidden[:, column_at]]
            dtype = self.explorer.array(view).dtype
            eps = float(np.finfo(dtype).eps) if dtype.kind == "f" else 0.0
            write = column(values, eps, self.floor() if view.grad and self.explorer.is_param(
                view.name) and not self.explorer.diff else 0.0)
            finite = values[np.isfinite(values)]
            widest = max((len(write(v)) for v in (finite.min(), finite.max())), default=1) \
                if finite.size else 4
            self._writers[key] = write, widest
        return self._writers[key]

    def floor(self) -> float:
        """The largest parameter gradient of the run: what a parameter's gradient's rounding
        noise is measured against (``d b_K`` is 0 in exact arithmetic, 1e-17 computed)."""
        if self._floor is None:
            self._floor = max((max(float(g.max()), -float(g.min()))   # no |g| copy made
                               for g in self.explorer.grads.values() if g.size), default=0.0)
        return self._floor

    def slice_table(self):
        """The slice around the cursor, as many cells as the pane holds; the labels and
        numbers of those cells only (a vocabulary axis has 50,257). Each column written at
        its scale; what is not shown said under it ("rows 0-6 of 50257"), as the CLI does."""
        ex, view = self.explorer, self.view
        matrix = ex.matrix(view)
        hidden = ex.hidden(view)
        one_d = ex.array(view).ndim == 1
        rows_axis, cols_axis = (None, 0) if one_d else view.shown
        n_rows, n_cols = matrix.shape
        at_row = 0 if one_d else view.index[rows_axis]
        at_col = view.index[cols_axis]
        pane = self.query_one("#tensor")
        width, height = max(20, pane.size.width or 60), max(3, pane.size.height or 12)
        axes = ex.axes(view.name)
        fixed = [f"{axes[a]} {view.index[a]}" for a in range(len(axes))
                 if a not in view.shown or one_d and a != 0]
        if ex.about(view):   # the circuit's method and metric
            fixed.append(ex.about(view))
        # the tensor, and on a line of its own where the slice sits on the axes not shown
        differs = ex.diff and view.name != CIRCUIT   # (a circuit's float64 run is not made)
        title = ((f"{ex.cfg.dtype} - float64: " if differs else "")
                 + f"{'d' if view.grad else ''}{view.name} ({', '.join(axes)}) "
                 f"{'x'.join(map(str, ex.array(view).shape))}"
                 + (f"\n{' · '.join(fixed)}" if fixed else ""))
        scale = ex.scale(view)
        legend = (f"red < 0 < blue, to |x| {scale:.3g}; 0 grey"
                  + (("; · no edge" if view.name == CIRCUIT else "; · masked")
                     if hidden is not None else ""))

        def lines(text: str) -> int:
            return sum(max(1, math.ceil(cell_len(line) / width)) for line in text.split("\n"))

        # the lines under the title and the column labels, above the legend: the rows, and
        # a line saying which rows and columns are shown when some are not
        room_lines = max(1, height - lines(title) - 1 - lines(legend))

        def window(fit: int) -> tuple[int, int]:
            r0 = min(max(0, at_row - fit // 2), max(0, n_rows - fit))
            return r0, min(n_rows, r0 + fit)

        r0, r1 = window(room_lines)
        label_width = 1 if one_d else min(LABEL, max(
            map(cell_len, ex.labels(view, rows_axis, r0, r1))) + 1)
        room = width - label_width
        n = min(n_cols, max(1, room // 5))
        while True:   # as many columns as fit, around the cursor
            c0 = min(max(0, at_col - n // 2), n_cols - n)
            col_labels = ex.labels(view, cols_axis, c0, c0 + n)
            writers = [self.writer(matrix, hidden, c) for c in range(c0, c0 + n)]
            widths = [max(w, min(HEADER, cell_len(label))) + 1
                      for (_, w), label in zip(writers, col_labels)]
            if sum(widths) <= room or n == 1:
                break
            n -= 1
        if n < n_cols or n_rows > room_lines:
            r0, r1 = window(max(1, room_lines - 1))
        row_labels = [""] if one_d else ex.labels(view, rows_axis, r0, r1)
        shown = []
        if r1 - r0 < n_rows:
            shown.append(f"rows {r0}-{r1 - 1} of {n_rows}")
        if n < n_cols:
            shown.append(f"columns {c0}-{c0 + n - 1} of {n_cols}")
        table = Table(box=None, padding=(0, 0), show_edge=False, pad_edge=False)
        table.add_column("", width=label_width, no_wrap=True)
        for label, w in zip(col_labels, widths):
            table.add_column(label[:w - 1], width=w, justify="right", no_wrap=True)
        for r, label in enumerate(row_labels, start=r0):
            cells = []
            for c, (write, _) in zip(range(c0, c0 + n), writers):
                value = float(matrix[r, c])
                if hidden is not None and hidden[r, c]:
                    text = Text("·", style="dim")
                else:
                    text = Text(write(value) if self.numbers else "", style=colour(value, scale))
                if r == at_row and c == at_col:
                    text.stylize("reverse")
                cells.append(text)
            table.add_row(label[:label_width - 1], *cells)
        caption = Text(legend, style="dim")
        if shown:
            caption.append("\n" + " · ".join(shown), style="dim")
        return Group(Text(title, style="italic"), table, caption)

    def overview(self):
        """Every block's every head's attention pattern of the row, small, in a grid: as many
        as the pane holds around the one chosen, each map pooled to at most 8 x 8 (a cell
        shows the largest weight it covers, so a sharp head stays sharp)."""
        ex, cfg = self.explorer, self.explorer.cfg
        row, block, head = self.grid
        pane = self.query_one("#tensor")
        width, height = max(20, pane.size.width or 60), max(3, pane.size.height or 20)
        title = (f"attention, row {row}: blocks {{}} of {cfg.layers} down, heads "
                 f"{{}} of {cfg.heads} across")
        title_lines = math.ceil(cell_len(title.format("00-00", "00-00")) / width)
        T = ex.values["blocks.0.attn.pattern"].shape[-1]
        size = max(1, min(T, 8, height - title_lines - 1))   # under the title and the heads
        across = max(1, min(cfg.heads, (width - 6) // (size + 1)))
        # a map's lines and a blank line under it, the last one's blank line not needed
        down = max(1, min(cfg.layers, (height - title_lines - 1 + 1) // (size + 1)))
        h0 = min(max(0, head - across // 2), cfg.heads - across)
        b0 = min(max(0, block - down // 2), cfg.layers - down)
        blues = ("#000000", "#1c263a", "#23355c", "#2a447f", "#3253a3", "#3a62c8")
        chunks = np.array_split(np.arange(T), size)
        grid = Table(box=None, padding=(0, 1, 0, 0))
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
                if b < b0 + down - 1:
                    lines.append(Text())   # a blank line between two blocks' maps
                cells.append(Text("\n").join(lines))
            grid.add_row(*cells)
        # the title above the table, not its own: a table's title wraps at the table's width
        title = title.format(f"{b0}-{b0 + down - 1}", f"{h0}-{h0 + across - 1}")
        return Group(Text(title, style="italic"), grid)
