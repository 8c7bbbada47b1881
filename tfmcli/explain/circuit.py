"""Circuits with exact books (``tfm circuit``): edge attribution patching (EAP), its
integrated-gradients form (EAP-IG), and the real effect of patching an edge (path patching).

The graph is the model's components. A **sender** writes into the residual stream: the
embedding (the first block's input), each head (its slice of the context times its rows of
W_O), each MLP (its output). With sandwich norms a block's heads are normed together before
they join the stream, so the block's attention is one sender. A **reader** reads the stream
through its own path: each head's queries, keys and values (a key or value head of a grouped
model is one reader, shared by the query heads it serves), each MLP, and the head at the end
(the logits). An edge joins a sender to every reader that reads the stream after it wrote;
in a parallel block the MLP reads the block's input, beside its heads.

**EAP** scores edge (u, v) as ``sum over rows and positions of (a_u(corrupted) - a_u(clean)) .
g_v``, g_v the metric's gradient at the clean run with respect to the stream where v reads it,
through v's path alone (its norm's backward of what v's weights send back). Since the stream
is the sum of the senders' outputs, the readers after u together read everything u wrote:
their gradients add up to the backward's gradient at u's output, and the edges out of u add
up to u's attribution patching score at the clean run. ``Books`` checks that on every run.

**EAP-IG** averages g_v over ``steps`` runs whose first block's input goes in a straight line
from the clean run's to the corrupted one's (the midpoints of ``steps`` equal parts): the
embedding's edges then add up to the real change of the metric, but for the integration's
error, which is reported.

**Path patching** (``Circuit.patched``): the clean run, in which every reader of the chosen
edges reads, through its path alone, the stream with those senders' outputs as the corrupted
run made them; everything after a changed reader sees what it made. One edge: its real effect
beside its estimate. The top k edges (``faithfulness``): the share of the corrupted run's
change they carry. Every edge: the corrupted run itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tfmcli.engine import blocks, ops
from tfmcli.engine.config import Config
from tfmcli.engine.inputs import Inputs
from tfmcli.engine.model import _block_masks, backward, forward, head_forward
from tfmcli.errors import TfmError
from tfmcli.explain.cells import norm_input
from tfmcli.explain.patching import metric_dlogits, metric_of, paired

BOOKS = 1e-10   # an identity holds to this much of the sum of its terms' magnitudes


def books_tolerance(cfg: Config) -> float:
    """How far an identity may miss (of its terms' magnitudes): ``BOOKS`` in float64; in a
    rounded dtype, what its rounding allows, each of the stream's 2 L + 1 sums (and their
    gradients') rounded to half the dtype's eps, times 8 for room. Measured on 2 blocks:
    3.6e-8 in float32 (allowed 2.4e-6), 2.1e-3 in bfloat16 (0.16)."""
    if cfg.dtype == "float64":
        return BOOKS
    from tfmcli.engine import precision

    return max(BOOKS, 8 * (2 * cfg.layers + 1) * precision.of(cfg.dtype).eps / 2)


@dataclass(frozen=True)
class Sender:
    """A component that writes into the residual stream: ``name`` ("emb", "a1.3" block 1's
    head 3, "a1" a sandwich block's attention, "m1" block 1's MLP), writing at ``at``."""

    name: str
    kind: str        # "emb", "head", "attn", "mlp"
    block: int       # -1 for the embedding
    head: int | None
    at: float


@dataclass(frozen=True)
class Reader:
    """A path that reads the stream: ``name`` ("a2.0.q", "a2.1.k" (a key head), "m2",
    "logits"), reading at ``at``."""

    name: str
    kind: str        # "q", "k", "v", "mlp", "logits"
    block: int       # layers for the logits
    head: int | None
    at: float


def graph(cfg: Config) -> tuple[list[Sender], list[Reader]]:
    """The senders and readers of ``cfg``'s model, in the order the stream meets them. A
    Post-LN model is refused: its norms sit on the stream, which is then no sum of what the
    components wrote."""
    if cfg.norm == "post":
        raise TfmError("a Post-LN model normalises the residual stream itself after each "
                       "sublayer, so the stream is no sum of the components' outputs and an "
                       "edge's share of it is not defined; tfm circuit needs a Pre-LN model")
    senders = [Sender("emb", "emb", -1, None, 0.0)]
    readers = []
    kv = cfg.h_kv
    for i in range(cfg.layers):
        base = 10.0 * i
        heads_write = base + (5 if cfg.parallel_residual else 2)
        for h in range(cfg.heads):
            readers.append(Reader(f"a{i}.{h}.q", "q", i, h, base + 1))
        for g in range(kv):
            readers.append(Reader(f"a{i}.{g}.k", "k", i, g, base + 1))
            readers.append(Reader(f"a{i}.{g}.v", "v", i, g, base + 1))
        if cfg.sandwich_norm:
            senders.append(Sender(f"a{i}", "attn", i, None, heads_write))
        else:
            senders += [Sender(f"a{i}.{h}", "head", i, h, heads_write) for h in range(cfg.heads)]
        readers.append(Reader(f"m{i}", "mlp", i, None, base + (1 if cfg.parallel_residual
                                                                 else 3)))
        senders.append(Sender(f"m{i}", "mlp", i, None, base + 5))
    readers.append(Reader("logits", "logits", cfg.layers, None, 10.0 * cfg.layers + 1))
    return senders, readers


def edge_mask(senders, readers) -> np.ndarray:
    """(senders, readers): True where the reader reads the stream after the sender wrote."""
    return np.array([[u.at < v.at for v in readers] for u in senders])


# ---------------------------------------------------------------- what a run writes and reads


def output_name(cfg: Config, sender: Sender) -> str:
    """The activation ``sender`` writes from: what it adds to the stream, but for a head, whose
    share is its columns of ``attn.context`` times its rows of W_O (``written``)."""
    p = f"blocks.{sender.block}."
    return {"emb": "blocks.0.in", "head": p + "attn.context", "attn": p + "ln1_post.out",
            "mlp": p + ("ln2_post.out" if cfg.sandwich_norm else "ffn.out")}[sender.kind]


def written(cfg: Config, params, acts, sender: Sender) -> np.ndarray:
    """What ``sender`` wrote into the stream in a run (its ``acts``): (B, T, d)."""
    if sender.kind != "head":
        return acts[output_name(cfg, sender)]
    dh, h = cfg.d_head, sender.head
    return acts[output_name(cfg, sender)][..., h * dh:(h + 1) * dh] @ \
        params[f"blocks.{sender.block}.attn.W_O"][h * dh:(h + 1) * dh]


def constant(cfg: Config, params, upto: float) -> np.ndarray | float:
    """What the stream holds at ``upto`` besides the senders' outputs: the attention's
    output biases (no head's own), the same in every run."""
    if cfg.sandwich_norm:
        return 0.0
    return sum((params[f"blocks.{i}.attn.b_O"] for i in range(cfg.layers)
                if f"blocks.{i}.attn.b_O" in params
                and 10.0 * i + (5 if cfg.parallel_residual else 2) < upto), 0.0)


def reader_norm(cfg: Config, reader: Reader) -> str:
    """The norm through which ``reader`` reads the stream ("blocks.2.ln1", "ln_f")."""
    p = f"blocks.{reader.block}."
    if reader.kind == "logits":
        return "ln_f"
    if reader.kind == "mlp" and not (cfg.parallel_residual and cfg.shared_norm):
        return p + "ln2"
    return p + "ln1"


def stream_at(cfg: Config, acts, reader: Reader) -> np.ndarray:
    """The stream ``reader`` reads in a run: its norm's input."""
    if reader.kind == "logits":
        return acts[f"blocks.{cfg.layers - 1}.out"]
    return acts[norm_input(cfg, reader_norm(cfg, reader) + ".out")]


def _weights(cfg: Config, params, reader: Reader) -> list[tuple[str, str, slice]]:
    """(its output's activation, its weight, the columns) of each product ``reader`` makes."""
    p = f"blocks.{reader.block}."
    if reader.kind == "mlp":
        parts = [("ffn.pre", "ffn.W_1")] + ([("ffn.gate", "ffn.W_gate")] if cfg.gated else [])
        return [(p + a, p + w, slice(None)) for a, w in parts]
    dh, h = cfg.d_head, reader.head
    which = reader.kind.upper()
    return [(p + f"attn.{reader.kind}", p + f"attn.W_{which}", slice(h * dh, (h + 1) * dh))]


def read_gradient(cfg: Config, params, acts, dacts, reader: Reader) -> np.ndarray:
    """The metric's gradient with respect to the stream where ``reader`` reads it, through
    its path alone: what its weights send back (``dy W^T``), through its norm's backward."""
    if reader.kind == "logits":
        return dacts[f"blocks.{cfg.layers - 1}.out"]
    x = stream_at(cfg, acts, reader)
    back = np.zeros_like(x)
    for act, weight, cols in _weights(cfg, params, reader):
        d = dacts[act]
        if d.ndim == 4:   # (B, H, T, d_head): this head's
            d = d[:, reader.head]
            back = back + d @ params[weight][:, cols].T
        else:
            back = back + d @ params[weight].T
    norm = reader_norm(cfg, reader)
    gamma = params[norm + ".gamma"]
    if cfg.rms_norm:
        _, cache = ops.rms_norm_forward(x, gamma, cfg.eps)
        return ops.rms_norm_backward(back, cache)[0]
    _, cache = ops.layer_norm_forward(x, gamma, None, cfg.eps)
    return ops.layer_norm_backward(back, cache)[0]


def write_gradient(cfg: Config, dacts, sender: Sender) -> np.ndarray:
    """The backward's gradient at what ``sender`` wrote: the stream's where it joins it (a
    head's: the gradient at its block's attention output, which its share adds to)."""
    if sender.kind == "head":
        return dacts[f"blocks.{sender.block}.attn.out"]
    return dacts[output_name(cfg, sender)]


# ---------------------------------------------------------------- the scores


@dataclass
class Circuit:
    """Every edge's score (``scores``, senders x readers, 0 where there is no edge), how it
    was made, the books, and the runs that path patching starts from."""

    method: str                 # "EAP" or "EAP-IG"
    metric: str
    senders: list[Sender]
    readers: list[Reader]
    mask: np.ndarray
    scores: np.ndarray
    clean: float                # the metric of the clean run
    corrupted: float            # of the corrupted run
    books: float                # the worst identity's miss, over its terms' magnitudes
    integration: float | None = None   # EAP-IG: the embedding's edges minus the real change
    steps: int = 0
    node_scores: np.ndarray = field(default_factory=lambda: np.zeros(0))   # per sender
    context: dict = field(default_factory=dict, repr=False)

    def edges(self) -> list[tuple[int, int]]:
        """Every edge (sender, reader), the largest |score| first."""
        pairs = list(zip(*np.nonzero(self.mask)))
        return sorted(pairs, key=lambda e: -abs(self.scores[e]))

    def name(self, edge) -> str:
        u, v = edge
        return f"{self.senders[u].name} → {self.readers[v].name}"

    def patched(self, edges) -> float:
        """The metric of the clean run with ``edges`` patched (the module docstring); over
        prompt pairs (``averaged``), the mean of each pair's."""
        c = self.context
        if "pairs" in c:   # a pair to a core (engine.parallel.each)
            from tfmcli.engine.parallel import each

            return float(np.mean(each(lambda pair: pair.patched(edges), c["pairs"])))
        return patched_metric(c["params"], c["clean_inputs"], c["cfg"], self.senders,
                              self.readers, c["clean_acts"], c["corrupt_acts"], edges,
                              self.metric, c["answer"], c["wrong"])

    def faithfulness(self, ks=None) -> list[tuple[int, float]]:
        """(k, the share of the corrupted run's change that the top k edges carry) for k =
        1, 2, 4, ... and every edge."""
        order = self.edges()
        n = len(order)
        if ks is None:
            ks = sorted({*(2 ** i for i in range(max(1, n).bit_length()) if 2 ** i < n), n})
        change = self.corrupted - self.clean
        return [(k, (self.patched(order[:k]) - self.clean) / change if change else np.nan)
                for k in ks]


def circuit(params, clean: Inputs, corrupted: Inputs, cfg: Config, metric: str = "loss",
            answer: int | None = None, wrong: int | None = None, steps: int = 0,
            progress=None) -> Circuit:
    """Every edge's EAP score (``steps`` > 0: EAP-IG's, over that many points of the line
    from the clean run's first-block input to the corrupted one's), the books checked: a
    ``TfmError`` when one does not hold. The loss is taken against the clean run's targets."""
    corrupted = paired(clean, corrupted, metric, answer, wrong)   # scored as the clean
    senders, readers = graph(cfg)
    mask = edge_mask(senders, readers)
    clean_fwd = forward(params, clean, cfg, fast=False)
    corrupt_fwd = forward(params, corrupted, cfg, fast=False)
    delta = np.stack([written(cfg, params, corrupt_fwd.acts, u) -
                      written(cfg, params, clean_fwd.acts, u) for u in senders])
    grads = backward(params, clean_fwd, cfg, metric_dlogits(clean_fwd, metric, answer, wrong))
    gradients = np.stack([read_gradient(cfg, params, clean_fwd.acts, grads.acts, v)
                          for v in readers])
    books = check_books(cfg, params, clean_fwd, grads, senders, readers, mask, gradients,
                        delta)
    integration = None
    if steps:
        gradients = integrated(params, clean_fwd, corrupt_fwd, cfg, readers, metric, answer,
                               wrong, steps, progress)
    flat = lambda a: a.reshape(len(a), -1)   # noqa: E731
    scores = np.where(mask, flat(delta) @ flat(gradients).T, 0.0)
    clean_metric = metric_of(clean_fwd, metric, answer, wrong)
    corrupt_metric = metric_of(corrupt_fwd, metric, answer, wrong)
    if steps:   # completeness: the embedding's edges against the real change
        integration = float(scores[0].sum() - (corrupt_metric - clean_metric))
    node = scores.sum(axis=1)
    context = {"params": params, "clean_inputs": clean, "cfg": cfg, "answer": answer,
               "wrong": wrong, "clean_acts": clean_fwd.acts, "corrupt_acts": corrupt_fwd.acts,
               # each reader's gradient, (readers, B, T, d): EAP-IG's the average over its runs
               "gradients": gradients,
               # an edge's score term by term: each row's and position's
               "terms": lambda edge: (delta[edge[0]] * gradients[edge[1]]).sum(axis=-1)}
    return Circuit("EAP-IG" if steps else "EAP", metric, senders, readers, mask, scores,
                   clean_metric, corrupt_metric, books, integration, steps, node, context)


def check_books(cfg, params, fwd, grads, senders, readers, mask, gradients, delta) -> float:
    """The identities EAP's scores rest on, at the clean run: the stream at each reader is the
    senders' outputs before it (and the output biases); the gradients of the readers after a
    sender add up to the backward's gradient at what it wrote; so the edges out of a sender
    add up to its attribution score. The worst miss over its terms' size; TfmError past
    ``books_tolerance``."""
    worst, tolerance = 0.0, books_tolerance(cfg)
    outputs = [written(cfg, params, fwd.acts, u) for u in senders]
    for v, reader in enumerate(readers):
        before = [outputs[u] for u in range(len(senders)) if mask[u, v]]
        made = sum(before) + constant(cfg, params, reader.at)
        stream = stream_at(cfg, fwd.acts, reader)
        size = sum(np.abs(o) for o in before).max() + 1e-300
        worst = _held(worst, tolerance, np.abs(made - stream).max() / size,
                      f"the stream {reader.name} reads is not the sum of the senders before it")
    for u, sender in enumerate(senders):
        after = gradients[mask[u]]
        total = write_gradient(cfg, grads.acts, sender)
        size = np.abs(after).sum(axis=0).max() + 1e-300
        worst = _held(worst, tolerance, np.abs(after.sum(axis=0) - total).max() / size,
                      f"the readers after {sender.name} do not read all it wrote")
        edges = (delta[u] * after).reshape(len(after), -1).sum(axis=1)
        node = float((delta[u] * total).sum())
        size = float(np.abs(delta[u] * np.abs(after).sum(axis=0)).sum()) + 1e-300
        worst = _held(worst, tolerance, abs(edges.sum() - node) / size,
                      f"the edges out of {sender.name} do not add up to its attribution")
    return worst


def _held(worst: float, tolerance: float, miss: float, what: str) -> float:
    if not miss <= tolerance:
        raise TfmError(f"the books do not balance: {what} (off by {miss:.1e} of its terms; "
                       f"a bug in tfm, please report it)")
    return max(worst, float(miss))


def integrated(params, clean_fwd, corrupt_fwd, cfg, readers, metric, answer, wrong, steps,
               progress=None) -> np.ndarray:
    """The readers' gradients averaged over ``steps`` runs whose first block's input is
    clean + (k - 1/2)/steps (corrupted - clean), k = 1..steps: the midpoint rule, whose error
    falls as 1/steps^2 (the right end's, k/steps, as 1/steps: 16% of the change still at 128
    steps on a random LLaMA whose metric's slope along the line runs from +15 to -2)."""
    start, end = clean_fwd.acts["blocks.0.in"], corrupt_fwd.acts["blocks.0.in"]
    total = 0.0
    for k in range(1, steps + 1):
        x = start + ((k - 0.5) / steps) * (end - start)
        fwd = stepped(params, clean_fwd.inputs, cfg, {"blocks.0.in": x})
        grads = backward(params, fwd, cfg, metric_dlogits(fwd, metric, answer, wrong))
        total = total + np.stack([read_gradient(cfg, params, fwd.acts, grads.acts, v)
                                  for v in readers])
        if progress is not None:
            progress(k, steps)
    return total / steps


# ---------------------------------------------------------------- path patching


class Replacing:
    """A pass's plan (``engine.interventions.Plan``'s interface) that hands on the given
    values in place of the activations they name, and nothing else."""

    def __init__(self, values: dict):
        self.values, self.steps, self.interventions = values, dict.fromkeys(values, ()), ()

    def __bool__(self) -> bool:
        return True

    def apply(self, name: str, x: np.ndarray) -> np.ndarray:
        return self.values.get(name, x)

    def through(self, name: str, dx: np.ndarray) -> np.ndarray:
        return dx


def stepped(params, inputs: Inputs, cfg: Config, values: dict):
    """``forward`` on the reference path with ``values`` in place of the activations they
    name (the backward goes through as if they were made so)."""
    from tfmcli.engine.model import unchecked_forward

    return unchecked_forward(params, inputs, cfg, fast=False, plan=Replacing(values))


def patched_metric(params, inputs: Inputs, cfg: Config, senders, readers, clean_acts,
                   corrupt_acts, edges, metric, answer, wrong) -> float:
    """The clean run, block by block, each reader of ``edges`` reading through its path the
    stream as this run made it plus, for each of its edges, the sender's corrupted output
    minus this run's (the module docstring); the metric."""
    into: dict[int, list[int]] = {}
    for u, v in edges:
        into.setdefault(int(v), []).append(int(u))
    B, T = inputs.tokens.shape
    masks = _block_masks(cfg, inputs.lengths, T, False, range(cfg.layers))
    x = clean_acts["blocks.0.in"]
    this: dict[str, np.ndarray] = {"blocks.0.in": x}   # this run's activations so far

    def corrected(v: int) -> np.ndarray | None:
        us = into.get(v)
        if not us:
            return None
        return sum(written(cfg, params, corrupt_acts, senders[u]) -
                   written(cfg, params, this, senders[u]) for u in us)

    with np.errstate(all="ignore"):
        for i in range(cfg.layers):
            attn = [v for v, r in enumerate(readers) if r.block == i and r.kind in ("q", "k", "v")]
            values = _read_anew(cfg, params, this, readers, attn, corrected, x)
            t = _tape(params, cfg, values, masks)
            blocks.block(t, x, i)
            this.update(t.acts)
            mlp = next(v for v, r in enumerate(readers) if r.block == i and r.kind == "mlp")
            more = _read_anew(cfg, params, this, readers, [mlp], corrected, x)
            if more:   # the MLP reads heads of this block: the block again, both read anew
                t = _tape(params, cfg, {**values, **more}, masks)
                blocks.block(t, x, i)
                this.update(t.acts)
            x = this[f"blocks.{i}.out"]
        final = len(readers) - 1
        t = _tape(params, cfg, {}, masks)
        change = corrected(final)
        if change is not None:
            t = _tape(params, cfg, {"ln_f.out": blocks.normalise(x + change, params, "ln_f",
                                                                  cfg)}, masks)
        loss = head_forward(t, x, inputs)
    from tfmcli.engine.model import Forward

    return metric_of(Forward(loss, t.acts, inputs, t.caches), metric, answer, wrong)


def _tape(params, cfg, values, masks):
    caches = {"fast": False, "cfg": cfg, **({"plan": Replacing(values)} if values else {})}
    return blocks.Tape(params, cfg, caches, masks)


def _read_anew(cfg, params, this, readers, chosen, corrected, x) -> dict:
    """The activations ``chosen`` readers make from the stream they read, changed by their
    edges (``corrected``): whole tensors, made as the block makes them (``linear_forward``
    of the norm's output), the other heads' from the stream unchanged."""
    values: dict[str, np.ndarray] = {}
    for v in chosen:
        change = corrected(v)
        if change is None:
            continue
        reader = readers[v]
        norm = reader_norm(cfg, reader)
        stream = x if reader.kind in ("q", "k", "v") else stream_at(cfg, this, reader)
        normed = blocks.normalise(stream + change, params, norm, cfg)
        for act, weight, cols in _weights(cfg, params, reader):
            bias = params.get(weight.replace("W_", "b_"))
            made = ops.linear_forward(normed, params[weight], bias)[0]
            if reader.kind == "mlp":
                values[act] = made
                continue
            heads = cfg.heads if reader.kind == "q" else cfg.h_kv
            if act not in values:   # the other heads' as the block makes them
                plain = blocks.normalise(stream, params, norm, cfg)
                values[act] = ops.split_heads(ops.linear_forward(plain, params[weight],
                                                                 bias)[0], heads).copy()
            values[act][:, reader.head] = ops.split_heads(made, heads)[:, reader.head]
    return values


# ---------------------------------------------------------------- where an estimate fails

DISAGREE = 0.25   # an estimate and its real patch apart by more than this share of the larger
SATURATED = 0.2   # nats: a pattern this sure puts about 0.95 or more on one key, its slope
                  # p (1 - p) a fifth of an even split's or less


def metric_positions(c: Circuit) -> np.ndarray:
    """(B, T) True where the metric reads the run: each row's last real position for a logit
    difference, every scored position for the loss."""
    inputs = c.context["clean_inputs"]
    B, T = inputs.tokens.shape
    if c.metric == "logit-diff":
        return np.arange(T)[None, :] == (inputs.lengths - 1)[:, None]
    from tfmcli.engine.inputs import IGNORE

    return inputs.targets != IGNORE


def why(c: Circuit, edge, real: float) -> str:
    """Why edge's EAP estimate and its real patch disagree (by more than DISAGREE of the
    larger), when tfm can tell: the reader's softmax saturated (its pattern's mean entropy, in
    nats, at the positions the metric reads, under SATURATED), its norm's scale moved (the
    stream's RMS where it reads, clean against patched, by more than 10%), or the estimate's
    terms cancel (their sum under a tenth of their magnitudes); "" where they agree or none
    of these holds."""
    u, v = edge
    estimate = float(c.scores[edge])
    if abs(estimate - real) <= DISAGREE * max(abs(estimate), abs(real)):
        return ""
    if "pairs" in c.context:   # the pair that differs most says why
        worst = max(c.context["pairs"], key=lambda p: abs(p.scores[edge] - (
            p.patched([edge]) - p.clean)))
        return why(worst, edge, worst.patched([edge]) - worst.clean)
    ctx, cfg = c.context, c.context["cfg"]
    sender, reader = c.senders[u], c.readers[v]
    said = []
    if reader.kind in ("q", "k", "v"):
        heads = [reader.head] if reader.kind == "q" else range(
            reader.head * cfg.group, (reader.head + 1) * cfg.group)
        pattern = ctx["clean_acts"][f"blocks.{reader.block}.attn.pattern"]
        with np.errstate(divide="ignore", invalid="ignore"):
            p = pattern[:, list(heads)]
            per_query = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)   # (B, h, T)
        entropy = float(per_query.transpose(0, 2, 1)[metric_positions(c)].mean())
        if entropy < SATURATED:
            said.append(f"a{reader.block}'s softmax saturated (entropy {entropy:.2f})")
    stream = stream_at(cfg, ctx["clean_acts"], reader)
    delta = written(cfg, ctx["params"], ctx["corrupt_acts"], sender) - \
        written(cfg, ctx["params"], ctx["clean_acts"], sender)

    def rms(x):
        return np.sqrt((x * x).mean(axis=-1))

    moved = float(np.abs(rms(stream + delta) / rms(stream) - 1).max())
    if moved > 0.1:
        said.append(f"its norm's scale moved {moved:.0%}")
    terms = c.context.get("terms")
    if terms is not None:
        t = terms(edge)
        if abs(t.sum()) < 0.1 * np.abs(t).sum():
            said.append(f"its terms cancel ({t.sum():+.2g} of {np.abs(t).sum():.2g})")
    return "; ".join(said) or "not linear here"


# ---------------------------------------------------------------- over a set of prompt pairs


def averaged(circuits: list[Circuit]) -> Circuit:
    """The circuits of several prompt pairs (the same model) as one: each edge's score, the
    metrics and the senders' totals the mean over the pairs, the books the worst pair's; a
    path patch the mean of each pair's (``Circuit.patched``)."""
    first = circuits[0]

    def mean(values):
        return np.mean(np.stack([np.asarray(v, dtype=np.float64) for v in values]), axis=0)

    integration = None if first.integration is None else float(mean(
        [c.integration for c in circuits]))
    return Circuit(first.method, first.metric, first.senders, first.readers, first.mask,
                   mean([c.scores for c in circuits]), float(mean([c.clean for c in circuits])),
                   float(mean([c.corrupted for c in circuits])),
                   max(c.books for c in circuits), integration, first.steps,
                   mean([c.node_scores for c in circuits]),
                   {"pairs": circuits, "cfg": first.context["cfg"]})
