"""An edge of a circuit (``explain.circuit``) explained: its score as the sum, over rows r and
positions t, of ``Δ[r, t] . g[r, t]``: the activation difference (what the sender wrote into
the stream, the corrupted run's minus the clean run's) dotted with the gradient (the metric's,
at the clean run, with respect to the stream where the reader reads it, through its path
alone), with the run's numbers.

Δ is made again here from the two runs' activations (``circuit.written``), g read from what
the scores were made of (EAP: the clean run's backward; EAP-IG: the average over its runs),
and their terms' sum is held against the score before anything is shown, as a cell's formula
is (``cells.Explanation``): a mismatch is a bug in tfm, said so. A cell of the senders x
readers grid that is no edge says why: the reader reads the stream before the sender writes
into it. ``ends`` says where the edge's two ends are in the run: the tensor the sender writes
from and the tensor the reader makes, at the row and position whose term is largest.

The explorer (``tui``) draws these; nothing here renders.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfmcli.explain.cells import Explanation, holds_to
from tfmcli.explain.circuit import (
    Circuit,
    Reader,
    Sender,
    output_name,
    reader_norm,
    written,
)
from tfmcli.explain.gradients import aligned
from tfmcli.render.numbers import column

TOP = 4   # terms listed one by one; the rest summed in one line


@dataclass(frozen=True)
class NoEdge:
    """A cell of the grid that is no edge: why (``lines``), as an explanation's text."""

    where: str
    lines: tuple[str, ...]
    claimed = None
    holds = True
    bug = False

    def text(self) -> list[str]:
        return [f"{self.where}: no edge", *self.lines]


@dataclass(frozen=True)
class End:
    """One end of an edge in the run: tensor ``name`` at ``index`` (the row and position
    whose term is largest), the two axes to show, and what it is."""

    name: str
    index: tuple[int, ...]
    shown: tuple[int, int]
    what: str


# ---------------------------------------------------------------- in words


def sender_words(sender: Sender) -> str:
    """"head 0.1's output", "the embedding", "block 2's MLP's output"."""
    return {"emb": "the embedding", "head": f"head {sender.block}.{sender.head}'s output",
            "attn": f"block {sender.block}'s attention's output",
            "mlp": f"block {sender.block}'s MLP's output"}[sender.kind]


def reader_words(cfg, reader: Reader) -> str:
    """"head 1.0's keys" (a key head of a grouped model: "key head 1.0's keys, for heads
    1.0-1.1"), "block 1's MLP", "the logits"."""
    if reader.kind == "q":
        return f"head {reader.block}.{reader.head}'s queries"
    if reader.kind in ("k", "v"):
        what = {"k": "keys", "v": "values"}[reader.kind]
        if cfg.group == 1:
            return f"head {reader.block}.{reader.head}'s {what}"
        first = reader.head * cfg.group
        return (f"{what[:-1]} head {reader.block}.{reader.head}'s {what}, for heads "
                f"{reader.block}.{first}-{reader.block}.{first + cfg.group - 1}")
    return "the logits" if reader.kind == "logits" else f"block {reader.block}'s MLP"


def _written_at(cfg, sender: Sender) -> str:
    """Where in the stream ``sender`` writes."""
    if sender.kind == "emb":
        return "the first block's input"
    if sender.kind == "mlp" or cfg.parallel_residual:
        return f"block {sender.block}'s output"
    return f"block {sender.block}'s middle, after its attention"


def _read_at(cfg, reader: Reader) -> str:
    """Where in the stream ``reader`` reads."""
    if reader.kind == "logits":
        return "the last block's output"
    if reader.kind in ("q", "k", "v") or cfg.parallel_residual:
        return f"block {reader.block}'s input"
    return f"block {reader.block}'s middle, after its attention"


def _difference_words(cfg, sender: Sender) -> str:
    made = output_name(cfg, sender)
    if sender.kind == "head":
        made += f"'s head-{sender.head} columns x its rows of W_O"
    return f"Δ: what {sender.name} wrote, corrupted - clean: {made}"


def _gradient_words(c: Circuit, reader: Reader) -> list[str]:
    cfg = c.context["cfg"]
    metric = "loss" if c.metric == "loss" else "logit-diff"
    if reader.kind == "logits":
        path = "through ln_f and the head"
    else:
        weights = {"q": "W_Q", "k": "W_K", "v": "W_V"}.get(reader.kind)
        if weights is None:
            weights = "W_1 and W_gate" if cfg.gated else "W_1"
        else:
            weights += f"'s head-{reader.head} columns"
        path = f"through {reader_norm(cfg, reader)} and {weights}"
    at = ("at the clean run" if not c.steps else
          f"averaged over {c.steps} runs from clean to corrupted (EAP-IG)")
    return [f"g: d {metric} / d the stream where {reader.name} reads it, {path}, {at}"]


# ---------------------------------------------------------------- the factors


def difference(c: Circuit, u: int) -> np.ndarray:
    """Δ: what sender ``u`` wrote in the corrupted run minus the clean run's, (B, T, d),
    made again from the runs' activations."""
    ctx = c.context
    sender = c.senders[u]
    return (written(ctx["cfg"], ctx["params"], ctx["corrupt_acts"], sender)
            - written(ctx["cfg"], ctx["params"], ctx["clean_acts"], sender))


def gradient(c: Circuit, v: int) -> np.ndarray:
    """g: the metric's gradient with respect to the stream where reader ``v`` reads it,
    through its path, (B, T, d): the one the scores were made of."""
    return c.context["gradients"][v]


def terms(c: Circuit, u: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each row's and position's Δ . g, |Δ|, |g|), each (B, T)."""
    delta, g = difference(c, u), gradient(c, v)
    return (delta * g).sum(axis=-1), np.linalg.norm(delta, axis=-1), np.linalg.norm(g, axis=-1)


# ---------------------------------------------------------------- the cell explained


def explain_edge(run, c: Circuit, u: int, v: int) -> Explanation | NoEdge:
    """Cell (sender ``u``, reader ``v``) of the grid: an edge's score as its terms, checked
    against ``c.scores``; or, where there is no edge, why."""
    cfg = c.context["cfg"]
    sender, reader = c.senders[u], c.readers[v]
    where = c.name((u, v))
    if not c.mask[u, v]:
        return NoEdge(where, (
            "the reader reads the stream before the sender writes into it:",
            f"  {reader.name}, {reader_words(cfg, reader)}, reads it at {_read_at(cfg, reader)}",
            f"  {sender.name}, {sender_words(sender)}, writes at {_written_at(cfg, sender)}"))
    products, dsize, gsize = terms(c, u, v)
    recorded = float(c.scores[u, v])
    claimed = float(products.sum())
    size = float(np.abs(products).sum())   # what rounding acts on
    order = np.argsort(-np.abs(products), axis=None, kind="stable")
    order, zeros = order[products.flat[order] != 0], order[products.flat[order] == 0]
    listed, rest = order[:TOP], order[TOP:]
    write = column([products.flat[k] for k in listed] + ([products.flat[rest].sum()]
                                                         if rest.size else []))
    # each factor's size at its own scale (a loss's gradient is far smaller than Δ)
    dwrite, gwrite = (column(norms.flat[listed]) for norms in (dsize, gsize))
    T = products.shape[1]
    rows: list[tuple[str, str | None]] = [("largest terms Δ . g:" if rest.size or zeros.size
                                           else "terms Δ . g:", None)]
    for k in listed:
        r, t = divmod(int(k), T)
        label = run.token_labels(r)[t] if t < len(run.token_labels(r)) else ""
        rows.append((f"  r{r} t{t}:{label}" if label else f"  r{r} t{t}", write(
            products.flat[k])))
        rows.append((f"    |Δ| {dwrite(dsize.flat[k]).lstrip('+')}  "
                     f"|g| {gwrite(gsize.flat[k]).lstrip('+')}", None))
    if rest.size:
        rows.append((f"  {rest.size} more", write(products.flat[rest].sum())))
    if zeros.size:   # (Δ is 0 where the two runs' tokens so far are the same)
        why = (" (Δ = 0)" if not dsize.flat[zeros].any() else
               " (g = 0)" if not gsize.flat[zeros].any() else "")
        rows.append((f"  {zeros.size} more, each 0{why}", None))
    total = column([claimed, recorded], floor=size)
    both = [total(claimed).strip(), total(recorded).strip()]
    if both[0] != both[1]:
        both = [column([x], floor=size)(x).strip() for x in (claimed, recorded)]
    # the check first, under the formula (at 80 x 24 it is on the first screen), the terms after
    checked, *terms_lines = aligned([("sum", both[0]), (f"score ({c.method})", both[1]), *rows])
    lines = (f"{sender_words(sender)}, as read by {reader_words(cfg, reader)}",
             "= sum over r, t of Δ[r, t] . g[r, t]",   # rows r, positions t
             checked, terms_lines[0], _difference_words(cfg, sender),
             *_gradient_words(c, reader), *terms_lines[1:])
    return Explanation(where, recorded, claimed, lines,
                       (output_name(cfg, sender), made_name(reader)), size, (),
                       holds_to(cfg.dtype))


# ---------------------------------------------------------------- its two ends


def made_name(reader: Reader) -> str:
    """The tensor ``reader`` makes from the stream: a head's ``attn.q``, ``k`` or ``v``, an
    MLP's ``ffn.pre``, the logits."""
    if reader.kind == "logits":
        return "logits"
    return f"blocks.{reader.block}." + ("ffn.pre" if reader.kind == "mlp" else
                                         f"attn.{reader.kind}")


def ends(run, c: Circuit, u: int, v: int) -> tuple[End, End]:
    """The edge's two ends in the clean run, at the row and position of its largest term:
    the tensor the sender writes from (the embedding's ``blocks.0.in``, a head's columns of
    ``attn.context``, an MLP's ``ffn.out``) at the column that adds most to the term, and the
    tensor the reader makes (a head's ``attn.q``, ``k`` or ``v``, the MLP's ``ffn.pre``, the
    logits at the answer, else at the target)."""
    ctx, cfg = c.context, c.context["cfg"]
    sender, reader = c.senders[u], c.readers[v]
    delta, g = difference(c, u), gradient(c, v)
    products = (delta * g).sum(axis=-1)
    r, t = np.unravel_index(int(np.argmax(np.abs(products))), products.shape)
    r, t = int(r), int(t)
    name = output_name(cfg, sender)
    if sender.kind == "head":
        dh, h = cfg.d_head, sender.head
        cols = slice(h * dh, (h + 1) * dh)
        context = ctx["corrupt_acts"][name][r, t, cols] - ctx["clean_acts"][name][r, t, cols]
        back = ctx["params"][f"blocks.{sender.block}.attn.W_O"][cols] @ g[r, t]   # (d_head,)
        column_at = h * dh + int(np.argmax(np.abs(context * back)))
        what = f"head {sender.block}.{h}'s columns of its context"
    else:
        column_at = int(np.argmax(np.abs(delta[r, t] * g[r, t])))
        what = sender_words(sender)
    sent = End(name, (r, t, column_at), (1, 2), f"{sender.name}: {what}")
    if reader.kind in ("q", "k", "v"):
        made = End(made_name(reader), (r, reader.head, t, 0), (2, 3),
                   f"{reader.name}: {reader_words(cfg, reader)}")
    elif reader.kind == "mlp":
        made = End(made_name(reader), (r, t, 0), (1, 2), f"{reader.name}: its input, ffn.pre")
    else:
        target = int(run.inputs.targets[r, t])
        token = ctx["answer"] if c.metric == "logit-diff" else (target if target >= 0 else 0)
        made = End("logits", (r, t, int(token)), (1, 2), "logits")
    return sent, made
