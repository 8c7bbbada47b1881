"""What the explorer shows, without Textual: the run's tensors, a 2-D slice of one with named
axes and token labels, the cell under the cursor explained, where a cell came from, and the
``tfm`` command that prints the same view outside the explorer.

``Explorer`` holds one computed run (forward and backward, once); a ``View`` is one screen of
it (which tensor, value or gradient, which two axes are shown, the index on every other axis,
the cursor). The app (``tui.app``) only draws views and moves between them.

Opened with a corrupted run (``--from-tokens``), the explorer holds its circuit too
(``explain.circuit``, computed once): the edge scores are one more tensor, ``circuit``, senders
down and readers across, a cell that is no edge hidden as a masked score is; a cell is
explained as its two factors (``explain.edges``) and followed to either of its two ends.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from tfmcli.explain.cells import SOURCES, explain_value
from tfmcli.explain.edges import End, explain_edge
from tfmcli.explain.edges import ends as edge_ends
from tfmcli.explain.gradients import explain_gradient

HEADS = re.compile(r"attn\.(q|k|v|q_rot|k_rot|q_norm\.out|k_norm\.out)$")
CIRCUIT = "circuit"   # the circuit's edge scores, (senders, readers): a tensor of the explorer


@dataclasses.dataclass(frozen=True)
class View:
    """One screen: tensor ``name`` (its gradient with ``grad``), the two axes shown (rows,
    columns), the index on each axis (those shown: the cursor)."""

    name: str
    grad: bool
    shown: tuple[int, int]
    index: tuple[int, ...]

    def moved(self, axis: int, step: int, size: int) -> "View":
        index = list(self.index)
        index[axis] = (index[axis] + step) % size
        return dataclasses.replace(self, index=tuple(index))


class Explorer:
    """A run computed once: its activations, their gradients, the parameters and theirs."""

    def __init__(self, run, fwd, grads, argv: list[str], against=None, circuit=None,
                 circuit_argv: list[str] | None = None):
        self.run, self.fwd, self.grads, self.argv = run, fwd, grads, argv
        self.cfg = run.cfg
        self.values = {**fwd.acts, **run.params}
        # the circuit of a corrupted run (explain.circuit.Circuit), and the options that
        # made it (--from-tokens ..., --metric ...): tfm circuit's command line with argv's
        self.circuit, self.circuit_argv = circuit, list(circuit_argv or [])
        if circuit is not None:
            self.values[CIRCUIT] = circuit.scores
        self.gradients = {**grads.acts, **{n: g for n, g in grads.items()}}
        self._scales: dict = {}
        self._differences: dict = {}   # (name, grad) -> its difference from float64 (p)
        # a run in float32, float16 or bfloat16: the same run in float64 beside it
        # (``explain.precision.compared``), and whether each cell shows its difference
        self.against, self.diff = against, False

    # ------------------------------------------------------------ the tree

    def names(self) -> list[str]:
        """Every tensor: the activations in forward order, then the parameters."""
        return [*self.fwd.acts, *self.run.params]

    def tree(self, text: str = "") -> list[tuple[int, str, str, str | None]]:
        """The list on the left, as (depth, label, shape, id) lines: the activations, their
        gradients, the parameters, theirs, each block's under its name; ``id`` (``v:NAME``, or
        ``g:NAME`` for a gradient) is None on a heading. ``text`` keeps the names holding it."""
        sections = [("activations", list(self.fwd.acts), "v"),
                    ("activation gradients", [n for n in self.fwd.acts if self.has_grad(n)], "g"),
                    ("parameters", list(self.run.params), "v"),
                    ("parameter gradients", [n for n in self.run.params if self.has_grad(n)],
                     "g")]
        lines = []
        if self.circuit is not None and text.lower() in "circuit edge scores":
            c = self.circuit
            lines += [(0, f"circuit ({c.method}, {c.metric})", "", None),
                      (1, "edge scores", "x".join(map(str, c.scores.shape)), f"v:{CIRCUIT}")]
        for title, names, kind in sections:
            names = [n for n in names if text.lower() in n.lower()]
            if not names:
                continue
            lines.append((0, title, "", None))
            block = None
            for name in names:
                shape = "x".join(map(str, self.values[name].shape))
                m = re.match(r"(blocks\.\d+)\.(.*)", name)
                if m and m[1] != block:
                    block = m[1]
                    lines.append((1, block, "", None))
                elif not m:
                    block = None
                lines.append((2 if m else 1, m[2] if m else name, shape, f"{kind}:{name}"))
        return lines

    @staticmethod
    def tree_id(view: View) -> str:
        return f"{'g' if view.grad else 'v'}:{view.name}"

    def is_param(self, name: str) -> bool:
        return name in self.run.params

    def array(self, view: View) -> np.ndarray:
        """The tensor ``view`` shows: its values or gradient, or (``diff``) their difference
        from float64's, cell by cell."""
        if self.diff and view.name != CIRCUIT:   # (a circuit: float64's is not made)
            key = (view.name, view.grad)
            if key not in self._differences:
                truth, low = (np.asarray(a, np.float64) for a in
                              self.against.arrays(view.name, view.grad)[:2])
                with np.errstate(all="ignore"):   # the same inf in both: no difference
                    self._differences[key] = np.where(low == truth, 0.0, low - truth)
            return self._differences[key]
        return (self.gradients if view.grad else self.values)[view.name]

    def toggle_diff(self) -> str | None:
        """Show each cell's difference from float64 (or its value again); None when done,
        else why it cannot be. ``against``: the comparison, or what makes it (the first p
        makes it: the explorer opens as fast without), or why there is none."""
        from tfmcli.errors import TfmError

        if self.against is None:
            return ("p shows a run's difference from float64: open the explorer with "
                    "--dtype bfloat16, float16 or float32")
        if isinstance(self.against, str):
            return self.against
        if callable(self.against):
            try:
                self.against = self.against()
            except TfmError as e:
                self.against = f"p: {e}"
                return self.against
        self.diff = not self.diff
        return None

    def has_grad(self, name: str) -> bool:
        return name in self.gradients

    # ------------------------------------------------------------ axes

    def axes(self, name: str) -> tuple[str, ...]:
        """The name of each axis of tensor ``name``: B, H, T (Tq and Tk for a score), d, ..."""
        shape = self.values[name].shape
        if name == CIRCUIT:
            return ("sender", "reader")
        if name.endswith(("attn.scores", "attn.pattern")):
            return ("B", "H", "Tq", "Tk")
        if HEADS.search(name):
            return ("B", "H", "T", "d_head")
        if len(shape) == 3:
            last = {"logits": "V", "probs": "V"}.get(name)
            if last is None:
                last = "d_ff" if ".ffn." in name and not name.endswith("ffn.out") else (
                    "d_q" if name.endswith("attn.context") else "d")
            return ("B", "T", last)
        if name == "pe":
            return ("T", "d")
        if name == "embed.W_E":
            return ("V", "d")
        if name == "embed.W_pos":
            return ("T", "d")
        if name == "head.W_U":
            return ("d", "V")
        if len(shape) == 2:
            return ("in", "out")
        return ("V",) if name == "head.b_U" else ("i",)

    def first_view(self, name: str, grad: bool = False) -> View:
        """Tensor ``name`` at its first entry, its last two axes shown (the circuit at its
        largest edge)."""
        if name == CIRCUIT:
            edges = self.circuit.edges()
            return View(CIRCUIT, False, (0, 1), tuple(map(int, edges[0])) if edges else (0, 0))
        ndim = self.values[name].ndim
        shown = (0, 0) if ndim == 1 else (ndim - 2, ndim - 1)
        return View(name, grad and self.has_grad(name), shown, (0,) * ndim)

    def labels(self, view: View, axis: int, start: int = 0, stop: int | None = None
               ) -> list[str]:
        """A label for each index ``start..stop`` of ``axis`` (all by default), as the CLI
        labels them: ``pos:token`` on a batch row's token axes (q2:4, k1:␣cat), numbers
        elsewhere (a vocabulary's ids; the positions of ``pe`` and ``W_pos``, which no token
        reads differently)."""
        kind = self.axes(view.name)[axis]
        size = self.values[view.name].shape[axis]
        span = range(start, size if stop is None else min(stop, size))
        if view.name == CIRCUIT:   # the senders' and readers' names
            parts = self.circuit.senders if kind == "sender" else self.circuit.readers
            return [parts[i].name for i in span]
        if kind in ("T", "Tq", "Tk") and self.axes(view.name)[0] == "B":
            tokens = self.run.token_labels(self.row(view))
            prefix = {"Tq": "q", "Tk": "k"}.get(kind, "t")
            return [f"{prefix}{t}:{tokens[t]}" if t < len(tokens) else f"{prefix}{t}"
                    for t in span]
        return [str(i) for i in span]

    def row(self, view: View) -> int:
        """The batch row ``view`` shows: its index on B, or 0 for a tensor without a batch
        axis (a parameter, ``pe``)."""
        return view.index[0] if self.axes(view.name)[0] == "B" else 0

    def scale(self, view: View) -> float:
        """The colour scale of the slice shown: its largest |value| (the masked left out),
        worked out once per slice."""
        key = (view.name, view.grad, view.shown, self.diff,
               tuple(i for a, i in enumerate(view.index) if a not in view.shown))
        if key not in self._scales:
            matrix = self.matrix(view)
            finite = np.abs(matrix[np.isfinite(matrix)])
            self._scales[key] = float(finite.max()) if finite.size else 0.0
        return self._scales[key]

    def matrix(self, view: View) -> np.ndarray:
        """The 2-D slice shown: rows along ``shown[0]``, columns along ``shown[1]`` (a 1-D
        tensor is one row)."""
        array = self.array(view)
        if array.ndim == 1:
            return array[None, :]
        index = list(view.index)
        a, b = view.shown
        index[a], index[b] = slice(None), slice(None)
        part = array[tuple(index)]
        return part if a < b else part.T

    def hidden(self, view: View) -> np.ndarray | None:
        """True where a score or pattern cell is hidden by the mask (as the CLI's ·), or a cell
        of the circuit is no edge."""
        if view.name == CIRCUIT:
            return ~self.circuit.mask if view.shown == (0, 1) else ~self.circuit.mask.T
        if not view.name.endswith(("attn.scores", "attn.pattern")) or set(view.shown) != {2, 3}:
            return None
        scores = self.fwd.acts[view.name.rsplit(".", 1)[0] + ".scores"]
        hidden = np.isneginf(scores[view.index[0], view.index[1]])
        return hidden if view.shown == (2, 3) else hidden.T

    def where(self, view: View) -> str:
        """``pattern[0, 1, q2, k1]``: the cell under the cursor, named (an edge: ``a0.1 →
        a1.0.k``)."""
        if view.name == CIRCUIT:
            return self.circuit.name(view.index)
        return f"{'d' if view.grad else ''}{self.short(view.name)}[{self.indices(view)}]"

    def indices(self, view: View) -> str:
        """``0, 1, q2, k1``: the cell's index on each axis, positions named by their axis."""
        axes = self.axes(view.name)
        return ", ".join({"Tq": f"q{i}", "Tk": f"k{i}", "T": f"t{i}"}.get(axes[axis], str(i))
                         for axis, i in enumerate(view.index))

    @staticmethod
    def short(name: str) -> str:
        """A tensor's name without its block and sublayer (the title above says them), but
        never shorter than tells it apart in its block: ``pattern``, ``W_Q``, ``ln1.gamma``,
        ``ln1.out``, ``q_norm.out`` and ``attn.out`` (``out`` is the block's own)."""
        tail = re.sub(r"^blocks\.\d+\.", "", name)
        tail = re.sub(r"^(attn|ffn|head|embed)\.(?!out$)", "", tail)
        return tail

    # ------------------------------------------------------------ moving

    def axis_named(self, view: View, kind: str) -> int | None:
        axes = self.axes(view.name)
        return axes.index(kind) if kind in axes else None

    def step(self, view: View, kind: str, step: int) -> View:
        """Move along axis ``kind`` (B: the row, H: the head) by ``step``, wrapping."""
        axis = self.axis_named(view, kind)
        if axis is None:
            return view
        return view.moved(axis, step, self.values[view.name].shape[axis])

    def move(self, view: View, down: int, right: int) -> View:
        """The cursor one cell down or right (within the shown slice)."""
        shape = self.values[view.name].shape
        if len(shape) == 1:
            return view.moved(0, right or down, shape[0])
        view = view.moved(view.shown[0], down, shape[view.shown[0]]) if down else view
        return view.moved(view.shown[1], right, shape[view.shown[1]]) if right else view

    def block(self, view: View, step: int) -> View:
        """The same tensor of the next (previous) block, at the same place."""
        match = re.match(r"blocks\.(\d+)\.(.*)", view.name)
        if not match:
            return view
        name = f"blocks.{(int(match[1]) + step) % self.cfg.layers}.{match[2]}"
        return dataclasses.replace(view, name=name) if name in self.values else view

    def swap(self, view: View) -> View:
        """Show the axes the other way round; with more than two, the next pair."""
        ndim = self.values[view.name].ndim
        a, b = view.shown
        if ndim <= 2 or (a, b) == (ndim - 1, ndim - 2):
            return dataclasses.replace(view, shown=(b, a)) if ndim > 1 else view
        return dataclasses.replace(view, shown=(b, a))

    def flip(self, view: View) -> View:
        """The tensor <-> its gradient."""
        return dataclasses.replace(view, grad=not view.grad) if self.has_grad(view.name) else view

    # ------------------------------------------------------------ the overview

    def overview_at(self, view: View) -> tuple[int, int, int]:
        """(row, block, head) the overview (``g``) opens at from ``view``: the batch row it
        shows, its block and head where it has them (a key or value head: the first query
        head it serves), else 0."""
        m = re.match(r"blocks\.(\d+)\.", view.name)
        axis = self.axis_named(view, "H")
        head = 0
        if axis is not None:
            head = view.index[axis] * (self.cfg.heads // self.values[view.name].shape[axis])
        return self.row(view), int(m[1]) if m else 0, head

    @staticmethod
    def pattern_view(row: int, block: int, head: int) -> View:
        """The attention pattern the overview's map of (row, block, head) opens."""
        return View(f"blocks.{block}.attn.pattern", False, (2, 3), (row, head, 0, 0))

    # ------------------------------------------------------------ following a number

    def follow(self, view: View) -> View | None:
        """The tensor the cell came from, at the right place: a pattern cell's score, a score's
        query row, a context column's pattern row, a residual sum's sublayer output, a norm's
        input, a projection's input row, the FFN's hidden layer, a block's input the block
        before it, an embedding its row of W_E, the logits' final norm; None when the cell
        has no one input (a parameter)."""
        name, index, cfg = view.name, view.index, self.cfg
        if name.endswith("attn.pattern"):
            return dataclasses.replace(view, name=name[:-len("pattern")] + "scores")
        if name.endswith("attn.scores"):
            query = name[:-len("scores")] + ("q_rot" if cfg.pe == "rope" else "q")
            return View(query, view.grad, (2, 3), (index[0], index[1], index[2], 0))
        if name.endswith("attn.context"):
            pattern = name[:-len("context")] + "pattern"
            head = min(index[2] // cfg.d_head, cfg.heads - 1)
            return View(pattern, view.grad, (2, 3), (index[0], head, index[1], 0))
        if name == "embed":
            token = int(self.run.inputs.tokens[index[0], index[1]])
            return View("embed.W_E", view.grad, (0, 1), (token, index[2]))
        if name in ("logits", "probs"):
            source = "logits" if name == "probs" else ("ln_f.out" if "ln_f.out" in self.values
                                                      else f"blocks.{cfg.layers - 1}.out")
            return self._at(view, source)
        if name == "ln_f.out":
            return self._at(view, f"blocks.{cfg.layers - 1}.out")
        m = re.match(r"(blocks\.(\d+)\.)(.*)", name)
        if not m:
            return None
        prefix, block, part = m[1], int(m[2]), m[3]
        if part == "in":
            return self._at(view, f"blocks.{block - 1}.out" if block else "embed")
        sources = dict(SOURCES)
        if cfg.norm == "post":   # Post-LN's norms read the sums
            sources.update({"ln1.out": "resid1", "ln2.out": "resid2", "out": "ln2.out"})
        source = sources.get(part)
        if source is None:
            return None
        if prefix + source not in self.values and source == "ln2.out":
            source = "ln1.out"   # a parallel block's FFN reads the attention's norm
        return self._at(view, prefix + source) if prefix + source in self.values else None

    def _at(self, view: View, target: str) -> View:
        """Tensor ``target`` at the same place as ``view`` as far as their axes agree: the
        same cell when the shapes are equal, else the same row and position."""
        shape, ours = self.values[target].shape, self.values[view.name].shape
        if shape == ours:
            return dataclasses.replace(view, name=target)
        b, t = (view.index[0], view.index[2]) if len(ours) == 4 else view.index[:2]
        column = 0
        if len(ours) == 4 and shape[-1] == ours[1] * ours[3]:   # a head's slice, side by side
            column = view.index[1] * ours[3] + view.index[3]
        return View(target, view.grad, (1, 2), (b, t, column))

    # ------------------------------------------------------------ an edge's two ends

    def ends(self, view: View) -> list[tuple[End, View]] | None:
        """An edge's two ends (``explain.edges.ends``), the sender's then the reader's, each
        with the view that opens it; None off the circuit or on a cell that is no edge."""
        if view.name != CIRCUIT or not self.circuit.mask[view.index]:
            return None
        made = []
        for end in edge_ends(self.run, self.circuit, *view.index):
            made.append((end, View(end.name, False, end.shown, end.index)))
        return made

    def about(self, view: View) -> str | None:
        """A line under a view's title: the circuit's method and metric, clean and
        corrupted."""
        if view.name != CIRCUIT:
            return None
        c = self.circuit
        return (f"{c.method} of the {c.metric}: clean {c.clean:.4f}, corrupted "
                f"{c.corrupted:.4f}; {int(c.mask.sum())} edges")

    # ------------------------------------------------------------ the explanation

    def explain(self, view: View) -> list[str]:
        """The selected cell: its value, and its formula with the run's numbers (a
        gradient's: its paths), checked against the value (``explain.cells``,
        ``explain.gradients``; an edge's score as its two factors: ``explain.edges``)."""
        if view.name == CIRCUIT:
            return explain_edge(self.run, self.circuit, *view.index).text()
        if self.diff:
            from tfmcli.explain.precision import cell_error

            return [f"{self.where(view)}", *cell_error(self.against, view.name, view.grad,
                                                        view.index)]
        if view.grad:
            explained = explain_gradient(self.run, self.fwd, self.grads, view.name, view.index,
                                         self.where(view))
            return explained.text() + (["c: check it by central differences"]
                                       if self.is_param(view.name) else [])
        explained = explain_value(self.run, self.fwd, view.name, view.index, self.where(view))
        return explained.text() + ([] if explained.claimed is not None or self.is_param(
            view.name) else ["(no formula for this tensor's cells here: Enter follows it "
                             "to what it was made from)"])

    # ------------------------------------------------------------ the check

    def central_difference(self, view: View, h: float = 1e-6) -> tuple[float, float]:
        """(the backward's gradient, the central difference) of the parameter entry under the
        cursor: (L(theta + h) - L(theta - h)) / 2h, in float64."""
        from tfmcli.engine.model import forward

        params = dict(self.run.params)
        entry = params[view.name].copy()
        params[view.name] = entry
        original = entry[view.index]
        losses = []
        for sign in (1, -1):
            entry[view.index] = original + sign * h
            losses.append(forward(params, self.run.inputs, self.cfg).loss)
        entry[view.index] = original
        return float(self.gradients[view.name][view.index]), (losses[0] - losses[1]) / (2 * h)

    # ------------------------------------------------------------ outside the explorer

    def command(self, view: View) -> str:
        """The ``tfm`` command that prints this view outside the explorer."""
        base = " ".join(self.argv)
        if view.name == CIRCUIT:
            return " ".join(["tfm circuit", *self.argv, *self.circuit_argv])
        if self.diff:   # every tensor's error against float64, as a table
            return f"tfm precision {base}".rstrip()
        m = re.match(r"blocks\.(\d+)\.(.*)", view.name)
        axes = self.axes(view.name)
        row = self.row(view)
        if axes[0] != "B" or view.grad:   # a parameter, pe, a gradient
            m = None
        if m and m[2] == "attn.pattern":
            return (f"tfm attn {base} --block {m[1]} --head {view.index[1]} --row {row} "
                    f"--query {view.index[2]}").replace("  ", " ")
        if m and re.fullmatch(r"ln[12](_post)?\.out", m[2]):
            return (f"tfm ln {base} --layer {m[2][:-4]} --block {m[1]} --row {row} "
                    f"-t {view.index[1]}").replace("  ", " ")
        if m and m[2].startswith("ffn."):
            return (f"tfm ffn {base} --block {m[1]} --row {row} "
                    f"-t {view.index[1]}").replace("  ", " ")
        command = "backward" if view.grad else "forward"
        return f"tfm {command} {base} --show {view.name} --row {row}".replace("  ", " ")
