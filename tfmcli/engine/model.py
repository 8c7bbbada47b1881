"""The stack: embed -> blocks -> head -> loss, and its hand-written backward.

``forward`` records every intermediate under a dotted name (the names and shapes of
``sizes.activation_shapes``, in that order) and keeps the caches the backward needs;
``backward`` walks the same path in reverse and returns every parameter's gradient, with the
gradient of every named activation alongside.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from dataclasses import dataclass, fields

import numpy as np

from tfmcli.engine import blocks, ops, parallel, precision
from tfmcli.engine.config import ADDED_PES, Config
from tfmcli.engine.inputs import IGNORE, Inputs, checked_inputs, inputs_from_tokens, make_inputs  # noqa: F401 (also re-exported: tfmcli.engine.model.IGNORE as before)
from tfmcli.engine.masks import combined_mask, padding_mask
from tfmcli.engine.positional import sinusoidal
from tfmcli.engine.sizes import param_misfit
from tfmcli.errors import InputsError


def check_params(params: dict, cfg: Config) -> None:
    """Raise ``InputsError`` unless ``params`` are exactly the parameters of ``cfg``'s model
    (``sizes.param_misfit``). A vocab or d_ff changed in the Config but not in the weights
    would otherwise run on the old sizes, and float64 weights under dtype float32 in float64."""
    misfit = param_misfit(params, cfg)
    if misfit is None:
        return
    kind, name, have, want, more = misfit
    names = name + (f" and {more} more" if more else "")
    raise InputsError({
        "missing": f"params is missing {names}, which this Config's model has "
                   f"(tfmcli.init_params(cfg) makes them all)",
        "unknown": f"params has {names}, which this Config's model does not have",
        "shape": f"params[{name!r}] has shape {have}; this Config gives {want}",
        "dtype": f"params[{name!r}] has dtype {have}; this Config's dtype is {want}"}[kind])


@dataclass
class Forward:
    """The result of a forward pass.

    Attributes
    ----------
    loss : float
    acts : OrderedDict name -> ndarray, in forward order
    inputs : Inputs
    caches : dict sublayer -> cache NamedTuple (what the backward reads)
    """

    loss: float
    acts: OrderedDict
    inputs: Inputs
    caches: dict

    @property
    def scored(self) -> int:
        """N: how many positions the loss averages over (valid, with a target)."""
        return self.caches["loss"].n

    def __repr__(self) -> str:
        """One line, not every array: in a notebook ``fwd`` shows what it holds."""
        return f"Forward(loss={self.loss!r}, scored={self.scored}, acts={arrays_repr(self.acts)})"


class Gradients(dict):
    """Parameter name -> gradient (same shape as the parameter).

    ``.acts`` maps every activation name of the forward to the gradient of the loss with respect
    to it, in forward order (``grads.acts["logits"]`` is ``(P - Y) / N``).
    """

    def __init__(self, params: dict, acts: OrderedDict):
        super().__init__(params)
        self.acts = acts

    def __repr__(self) -> str:
        """One line, not every array: in a notebook ``grads`` shows what it holds."""
        return f"Gradients({arrays_repr(self)}, acts={arrays_repr(self.acts)})"


def arrays_repr(named: dict) -> str:
    """``{21 arrays: 'embed' (2, 4, 6) … 'probs' (2, 4, 8)}``: how many, the first and the last
    with their shapes. The reprs of what holds a model's arrays use it, so that in a notebook
    they show as a line, not as every array."""
    if not named:
        return "{}"
    names = list(named)
    ends = names[:1] if len(names) == 1 else [names[0], names[-1]]
    shown = " … ".join(f"{name!r} {tuple(named[name].shape)}" for name in ends)
    return "{" + f"{len(names)} array{'s' if len(names) > 1 else ''}: {shown}" + "}"


# ---------------------------------------------------------------- positions and head


def positions(params: dict, cfg: Config, T: int):
    """(T, d) what is added to the embedding at each position, or None (``pe="none"`` and
    ``"rope"``, which turns queries and keys instead: ``rope_tables``).

    Sinusoidal: the fixed table; learned: the first T rows of ``embed.W_pos`` (a view).
    """
    if cfg.pe == "sinusoidal":
        return _sinusoidal_table(T, cfg.d_model, cfg.dtype)
    if cfg.pe == "learned":
        return params["embed.W_pos"][:T]
    return None


@functools.lru_cache(maxsize=8)
def _sinusoidal_table(T: int, d: int, dtype: str):
    """The table, made once per size for every forward after it (read-only: it is shared);
    rounded to float16 or bfloat16 in those."""
    policy = precision.of(dtype)
    table = policy.round(sinusoidal(T, d, policy.array))
    table.flags.writeable = False
    return table


def block_masks(cfg: Config, lengths, T: int, row: int) -> dict:
    """Block -> (T, T) bool: each block's mask for batch row ``row`` (``mask_for``); the views
    draw each block's attention over its own."""
    return {i: m[row] for i, m in _block_masks(cfg, lengths, T, False, range(cfg.layers)).items()}


def mask_for(cfg: Config, lengths, T: int, block: int = 0) -> np.ndarray:
    """(B, T, T) bool, True = may attend: the mask block ``block``'s attention applies to rows
    of these ``lengths`` (padding, and causal and sliding window as the Config says: the
    window only in the blocks ``sliding_layers`` names)."""
    return combined_mask(np.asarray(lengths), T, cfg.causal, cfg.window(block))


def _block_masks(cfg: Config, lengths, T: int, fast: bool, blocks) -> dict:
    """Each of these blocks' mask, by block: the fast path's ``ops.AttentionMask`` or the
    reference's (B, T, T) bool, one of each window the blocks have (two with
    ``sliding_layers``: the window's and every earlier key's)."""
    made = {}
    for window in {cfg.window(i) for i in blocks}:
        if fast:
            made[window] = _fast_mask(tuple(int(n) for n in lengths), T, cfg.causal, cfg.dtype,
                                      ops.QUERY_BLOCK, window)
        else:
            made[window] = combined_mask(np.asarray(lengths), T, cfg.causal, window)
    return {i: made[cfg.window(i)] for i in blocks}


@functools.lru_cache(maxsize=8)
def _fast_mask(lengths: tuple, T: int, causal: bool, dtype: str, block: int,
               window: int | None = None) -> ops.AttentionMask:
    """The fast path's mask, made once per lengths, size, window and query block (read-only:
    shared)."""
    mask = combined_mask(lengths, T, causal, window)                               # (B, T, T)
    bias = ops.additive_mask(mask[:, None], precision.of(dtype).array)           # (B, 1, T, T)
    bias.flags.writeable = False
    blocks = ops.key_blocks(mask, block)
    return ops.AttentionMask(bias, blocks, ops.hidden_from(mask, blocks),
                             ops.key_starts(mask, blocks))


def head_weights(params: dict, cfg: Config):
    """(W_U (d, V), b_U (V,) or 0): the head's weights; tied, W_U is the view ``W_E.T``."""
    W_U = params["embed.W_E"].T if cfg.tied_head else params["head.W_U"]
    return W_U, (params["head.b_U"] if cfg.head_bias else 0.0)


def head_logits(x: np.ndarray, params: dict, cfg: Config) -> np.ndarray:
    """The head on x (..., d): ``x W_U + b_U``, soft-capped with ``logit_softcap``."""
    logits = ops.linear_forward(x, *head_weights(params, cfg))[0]
    return logits if cfg.logit_softcap is None else ops.softcap_forward(logits, cfg.logit_softcap)


def check_within(caller: str | None, **bounds: tuple[int, int]) -> None:
    """A ``ValueError`` for the first index outside its range, each given as ``what=(value,
    upper)`` for ``0..upper - 1``: the views' explainers name the row, position, block or head
    they were asked for this way (NumPy would read row -1 as the last, and a head past the last
    as an empty slice)."""
    for what, (value, upper) in bounds.items():
        if not 0 <= value < upper:
            prefix = f"{caller}: " if caller else ""
            raise ValueError(f"{prefix}{what} {value} is outside 0..{upper - 1}")


def block_forward(params: dict, x: np.ndarray, cfg: Config, block: int, lengths,
                  fast: bool = True) -> np.ndarray:
    """Block ``block`` alone on ``x`` (B, T, d): its output (B, T, d). ``lengths`` (B,) are the
    rows' lengths, for the padding mask; ``params`` need hold only that block's parameters;
    ``fast=False`` takes the clear reference path, as ``forward`` does."""
    B, T = x.shape[:2]
    fast = fast and precision.of(cfg.dtype).exact   # rounded: the reference path (_engine)
    tape = blocks.Tape(params, cfg, {"fast": fast}, _block_masks(cfg, lengths, T, fast, [block]))
    with _engine(fast, cfg, B, T):
        return blocks.block(tape, x, block)


# ---------------------------------------------------------------- the model


def forward(params: dict, inputs: Inputs, cfg: Config, fast: bool = True,
            interventions=(), keep=None, seen=None, progress=None) -> Forward:
    """Run the model on ``inputs``; returns the loss and every named activation.

    Parameters
    ----------
    params : dict name -> ndarray, as made by ``init_params``
    inputs : Inputs with tokens (B, T), targets (B, T), lengths (B,)
    cfg : Config
    fast : bool
        Attention, layer norm and the embedding gradient through the fast path (``ops.*_fast``:
        fewer passes and fresh arrays), and the heavy operations in parts on the machine's cores
        (``tfmcli.engine.parallel``), equal to the reference path (False: plain NumPy) to rounding.
        The backward follows the forward's choice.
    interventions : sequence of ``Ablate``, ``Set``, ``Scale``, ``Patch``
        (``tfmcli.engine.interventions``): numbers changed as the pass makes them, in order;
        the backward goes through the changed graph. A target this model does not have, or
        an index outside it, raises ``InterventionError``.
    keep : set of activation names, optional
        Streamed: keep only these activations, besides each block's input and output, the
        embedding's and the head's; each block's others, and what its backward would read,
        are dropped as soon as the block is done, so a pass holds one block's at a time.
        ``backward`` then makes each block again from its input, one at a time, in reverse,
        and keeps the same activations' gradients. The numbers are the whole pass's, bit for
        bit.
    seen : callable, optional
        Streamed: ``seen("act", name, acts)`` is called for each activation the pass drops,
        before it drops it, with the block's activations (``acts[name]`` is the one); what it
        returns stays in ``acts`` in its place (a summary, say), None leaves nothing. A view
        that shows every activation's statistics, or a ``--save`` written as it goes, takes
        them this way.
    progress : callable, optional
        ``progress(done, layers)`` after each block (a progress bar's).
    """
    check_params(params, cfg)
    inputs = checked_inputs(inputs, cfg)
    return unchecked_forward(params, inputs, cfg, fast, plan=plan_for(interventions, cfg, inputs),
                             keep=keep, seen=seen, progress=progress)


def plan_for(interventions, cfg: Config, inputs: Inputs):
    """The interventions checked against this model's activations at the inputs' B and T, as
    the plan a pass applies; None when there are none."""
    if not interventions:
        return None
    from dataclasses import replace

    from tfmcli.engine.interventions import Plan
    from tfmcli.engine.sizes import activation_shapes

    B, T = inputs.tokens.shape
    shapes = activation_shapes(replace(cfg, batch=B, seq_len=T))
    return Plan(interventions, shapes, inputs.lengths)


def unchecked_forward(params: dict, inputs: Inputs, cfg: Config, fast: bool = True,
                      start: int = 0, x: np.ndarray | None = None, plan=None,
                      keep=None, seen=None, progress=None) -> Forward:
    """``forward`` without checking its arguments: for a loop over arguments that ``forward``
    has checked once (the gradient check's nudged copies of the parameters).

    ``start``: run only blocks ``start`` on, from ``x``, their first's input
    (``acts["blocks.{start}.in"]`` of a forward pass of the same parameters before it; with
    ``start = cfg.layers``, the last block's output), and what follows them: the same loss, bit
    for bit, when no parameter before block ``start`` changed. The returned acts begin there.
    ``plan``: the interventions (``plan_for``), applied as the activations are made.
    """
    fast = fast and precision.of(cfg.dtype).exact   # rounded: the reference path (_engine)
    with _engine(fast, cfg, *inputs.tokens.shape):
        return _forward(params, inputs, cfg, fast, start, x, plan, keep, seen, progress)


@contextlib.contextmanager
def _engine(fast: bool, cfg: Config, B: int, T: int):
    """The fast path of a step big enough (``threaded``) cuts its heavy operations into parts
    on the machine's cores (``tfmcli.engine.parallel``); the reference path, and the fast path of a
    smaller step, run in one piece: plain NumPy, each product on BLAS's own threads.

    Inside, the operations round as the Config's dtype says (``precision.using``). A float16
    or bfloat16 pass takes the reference path, in one piece: the fast path folds the scale
    into q and fuses steps that torch rounds between, and its parts run on threads that
    would not see the policy."""
    pieces = contextlib.nullcontext() if fast and threaded(cfg, B, T) else parallel.one_piece()
    with pieces, precision.using(precision.of(cfg.dtype)):
        yield


THREADED_ROWS = 1024   # B T from which a step's fast path always runs in parts (see threaded)
THREADED_WORK = 1 << 29


def largest_product(cfg: Config, B: int, T: int) -> int:
    """The multiply-adds of a step's largest matrix product on B sequences of T tokens (attention's
    T x T included), counted in float32's (``parallel.cost``)."""
    widest = max(cfg.d_model, cfg.ff, cfg.vocab, T)   # T: attention's scores, T x T
    return parallel.cost(B * T * cfg.d_model * widest, cfg.np_dtype)


def threaded(cfg: Config, B: int, T: int) -> bool:
    """Whether a step on B sequences of T tokens is big enough for tfm's threads to pay. A
    hand-off to another thread costs 0.1-0.5 ms, where BLAS's own threads, spinning, answer at
    once: on 256 rows (B T) parts lose, at any width, and on 512 rows unless the largest
    product (``largest_product``) comes to 2^29 multiply-adds of float32. Measured
    paired against one piece on two cores (16-20 rounds, B = 2, the fast path either way):
    T 128 took 0.70-0.82 of its threaded time in one piece (d 256 and 512, both dtypes), T 256
    d 384 0.78 in float32 (302 million) but 1.07 in float64 (604), T 256 d 512 1.04, and from
    1,024 rows one piece took 1.04-1.21 (T 512 d 256-512, T 1024 d 256)."""
    rows = B * T
    return rows >= THREADED_ROWS or (rows >= THREADED_ROWS // 2
                                     and largest_product(cfg, B, T) >= THREADED_WORK)


def _embed_forward(t: blocks.Tape, inputs: Inputs) -> np.ndarray:
    """The first block's input: the tokens' rows of W_E (times sqrt(d) with ``embed_scale``),
    plus the positions' rows when they are added, normalised with ``embed_norm``."""
    cfg = t.cfg
    x, t.caches["embed"] = ops.embedding_forward(inputs.tokens, t.P["embed.W_E"])  # (B, T, d)
    if cfg.embed_scale:   # sqrt(d_model) W_E[tokens] (a copy of the rows: scaled in place)
        x *= cfg.embed_factor
    x = t.keep("embed", x)
    pe = positions(t.P, cfg, inputs.tokens.shape[1])                               # (T, d)
    if pe is not None:
        x = t.round(x + t.keep("pe", pe))
    if cfg.embed_norm:   # BLOOM's: the embedding normalised before the first block
        x = blocks.norm(t, x, "ln_embed")
    return x


def _forward(params: dict, inputs: Inputs, cfg: Config, fast: bool, start: int = 0,
             x: np.ndarray | None = None, plan=None, keep=None, seen=None,
             progress=None) -> Forward:
    B, T = inputs.tokens.shape
    run = range(start, cfg.layers)
    caches = {"fast": fast, "cfg": cfg, "plan": plan} if plan else {"fast": fast, "cfg": cfg}
    t = blocks.Tape(params, cfg, caches, _block_masks(cfg, inputs.lengths, T, fast, run))
    caches, acts = t.caches, t.acts
    if start == 0:
        x = _embed_forward(t, inputs)
    for i in run:
        x = blocks.block(t, x, i)
        if keep is not None:   # streamed: the block's input and output, and what was asked
            _drop_block(t, i, keep, seen)
        if progress is not None:
            progress(i + 1, cfg.layers)
    if keep is not None:   # what the backward keeps of each block too
        caches["streamed"] = frozenset(keep)
    return Forward(head_forward(t, x, inputs), acts, inputs, caches)


def head_forward(t: blocks.Tape, x: np.ndarray, inputs: Inputs) -> float:
    """From the last block's output x to the loss: the final norm, the head, its cap, the
    logits and probabilities kept; the loss."""
    cfg, caches = t.cfg, t.caches
    if cfg.norm == "pre":
        x = blocks.norm(t, x, "ln_f")
    logits, caches["head"] = ops.linear_forward(x, *head_weights(t.P, cfg))        # (B, T, V)
    if cfg.logit_softcap is not None:   # c tanh(z / c): no logit reaches c
        logits = caches["capped logits"] = ops.softcap_forward(logits, cfg.logit_softcap)
    logits = t.keep("logits", logits)
    valid = padding_mask(inputs.lengths, inputs.tokens.shape[1]) & (inputs.targets != IGNORE)
    loss, probs, caches["loss"] = ops.cross_entropy_forward(logits, inputs.targets, valid)
    t.acts["probs"] = t.round(probs)   # the loss itself in float32 (ops.cross_entropy_forward)
    return loss


def _drop_block(t: blocks.Tape, i: int, keep, seen=None) -> None:
    """Forget block i's activations (but its input, its output and those in ``keep``) and its
    caches: a streamed pass holds one block's at a time. ``seen`` (``forward``'s) sees each
    before it goes."""
    p = f"blocks.{i}."
    _let_go(t.acts, [n for n in t.acts if n.startswith(p) and n not in keep
                     and n not in (p + "in", p + "out")], "act", seen)
    for name in [n for n in t.caches if isinstance(n, str) and n.startswith(p)]:
        del t.caches[name]


def _let_go(arrays: dict, names: list, kind: str, seen=None) -> None:
    """Drop ``names`` from ``arrays``, each first shown to ``seen(kind, name, arrays)``, whose
    answer stays in its place (None: nothing). Every answer is had before any array goes: a
    pattern's summary reads its scores."""
    answers = {name: seen(kind, name, arrays) for name in names} if seen else {}
    for name in names:
        if answers.get(name) is None:
            del arrays[name]
        else:
            arrays[name] = answers[name]   # (a key assigned keeps its place: forward order)


def backward(params: dict, fwd: Forward, cfg: Config, dlogits=None, keep=None,
             seen=None, progress=None) -> Gradients:
    """Gradients of ``fwd.loss`` for every parameter, and (``.acts``) every named activation.

    ``cfg`` must be the forward pass's: a backward of another model (GELU's derivative through
    a ReLU forward) would run on and return wrong gradients. ``dlogits`` (B, T, V): the
    gradients of another function of the logits instead, the one whose gradient with respect
    to the logits it is (a logit difference's: +1 and -1 at two tokens); ``probs`` then has
    no gradient (zeros).

    A streamed pass's backward (``forward(keep=...)``) holds one block's parameter gradients
    at a time when ``keep`` names the parameters whose gradients it returns: every other one
    is shown to ``seen("grad", name, grads)`` as soon as it is made and dropped (what ``seen``
    returns stays in its place), as each activation gradient that is not kept is, to
    ``seen("actgrad", name, dacts)``. ``progress(done, layers)``: after each block's
    backward (a progress bar's)."""
    ran = fwd.caches["cfg"]
    if cfg != ran:
        name = next(f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(ran, f.name))
        raise InputsError(f"backward: cfg is not the forward pass's Config ({name}="
                          f"{getattr(cfg, name)!r} here, {getattr(ran, name)!r} in the forward "
                          f"pass)")
    with _engine(fwd.caches["fast"], cfg, *fwd.inputs.tokens.shape):
        return _backward(params, fwd, cfg, dlogits, keep, seen, progress)


def _backward(params: dict, fwd: Forward, cfg: Config, upstream=None, keep=None,
              seen=None, progress=None) -> Gradients:
    t = blocks.Tape(params, cfg, fwd.caches)
    t.held, t.seen, t.progress = keep, seen, progress
    caches, grads, dacts = t.caches, t.grads, t.dacts
    # The weight gradients are made on another core while the chain of input gradients goes
    # on (parallel.deferred); every one is made by the scope's end, before the embedding's
    # rows are added to the tied head's.
    with parallel.deferred():
        dx, dW_U = _head_and_blocks_backward(t, upstream, fwd)
        if cfg.embed_norm:
            dx = blocks.norm_backward(t, dx, "ln_embed")
    embed_backward(t, dx, dW_U, params)
    if caches.get("streamed") is not None and keep is not None:   # the rest of the parameters'
        _let_go(grads, [n for n in grads if n not in keep and not n.startswith("blocks.")],
                "grad", seen)
    ordered_grads = {name: grads[name] for name in params if name in grads}
    ordered_dacts = OrderedDict((name, dacts[name]) for name in fwd.acts if name in dacts)
    return Gradients(ordered_grads, ordered_dacts)


def embed_backward(t: blocks.Tape, dx: np.ndarray, dW_U, params: dict) -> None:
    """From the first block's input gradient (through ``ln_embed``'s backward) dx: the
    embedding's and the positions' gradients kept, W_pos's and W_E's made (tied: W_E's rows
    added into the head's ``dW_U``)."""
    cfg, caches, grads, dacts = t.cfg, t.caches, t.grads, t.dacts
    dacts["embed"] = dx
    if cfg.pe in ADDED_PES:
        dacts["pe"] = t.round(dx.sum(axis=0))                                      # (T, d)
    if cfg.pe == "learned":   # rows past T were not used: their gradient is 0
        grads["embed.W_pos"] = np.zeros_like(params["embed.W_pos"])
        grads["embed.W_pos"][:dx.shape[1]] = t.through("pe", dacts["pe"])
    dx = t.through("embed", dx)   # an intervention on the embedding: what reaches W_E
    embedding_backward = ops.embedding_backward_fast if caches["fast"] else ops.embedding_backward
    # Tied, W_E is used twice, as the embedding and as the head: both count. The embedding's
    # rows are added to the head's (V, d) gradient in place, with no second (V, d) array.
    # Scaled, each row's gradient is sqrt(d_model) times the sum of its positions' dembed.
    lookup = t.round(dx * cfg.embed_factor) if cfg.embed_scale else dx
    grads["embed.W_E"] = embedding_backward(lookup, caches["embed"],
                                            out=dW_U if cfg.tied_head else None)


def _head_and_blocks_backward(t: blocks.Tape, upstream=None, fwd: Forward | None = None):
    """From the loss down to the embedding's output: its gradient, and the head's dW_U. A
    streamed pass's blocks (``forward(keep=...)``) are made again from their inputs, one at a
    time, and forgotten after their backward."""
    cfg = t.cfg
    dx, dW_U = head_backward(t, upstream)
    streamed = t.caches.get("streamed")
    for i in reversed(range(cfg.layers)):
        if streamed is not None:
            _block_again(t, fwd, i)
        dx = blocks.block_backward(t, dx, i)
        if streamed is not None:
            _forget_block(t, i, streamed)
        if t.progress is not None:
            t.progress(cfg.layers - i, cfg.layers)
    return dx, dW_U


def head_backward(t: blocks.Tape, upstream=None):
    """From the loss (or ``upstream``, another function's gradient at the logits) down to
    the last block's output: its gradient, and the head's dW_U (its W_U and b_U kept)."""
    caches, cfg, grads, dacts = t.caches, t.cfg, t.grads, t.dacts
    if upstream is None:
        dacts["probs"] = ops.cross_entropy_dprobs(caches["loss"])
        dlogits = t.keep_grad("logits", ops.cross_entropy_backward(caches["loss"]))   # (B, T, V)
    else:   # another function of the logits: its gradient given; the loss's probs unused
        dacts["probs"] = np.zeros_like(caches["loss"].probs)
        dlogits = t.keep_grad("logits", np.array(upstream, dtype=caches["loss"].probs.dtype))
    if cfg.logit_softcap is not None:   # back through the cap: times 1 - (logits / c)^2
        slope = ops.softcap_slope(caches["capped logits"], cfg.logit_softcap)    # (B, T, V)
        dlogits = t.round(np.multiply(dlogits, slope, out=slope))
    # tied, W_U is the view W_E.T: its gradient comes as (V, d), W_E's shape, to join W_E's
    dx, dW_U, db_U = ops.linear_backward(dlogits, caches["head"], transposed=cfg.tied_head)
    if not cfg.tied_head:
        grads["head.W_U"] = dW_U
    if cfg.head_bias:
        grads["head.b_U"] = db_U
    if cfg.norm == "pre":
        dx = blocks.norm_backward(t, dx, "ln_f")
    return dx, dW_U


def _block_again(t: blocks.Tape, fwd: Forward, i: int) -> None:
    """Block i of a streamed pass, made again from its input as the pass made it (its
    interventions too: their plan is the pass's), its caches into ``t``'s for its backward."""
    B, T = fwd.inputs.tokens.shape
    again = blocks.Tape(t.P, t.cfg, t.caches,
                        _block_masks(t.cfg, fwd.inputs.lengths, T, t.fast, [i]))
    blocks.KINDS[blocks.kind(t.cfg)][0](again, fwd.acts[f"blocks.{i}.in"], i)


def _forget_block(t: blocks.Tape, i: int, keep) -> None:
    """After block i's backward: its caches, and its gradients not asked for (its parameters'
    too when ``backward`` was given which to keep: once the other core has made them)."""
    p = f"blocks.{i}."
    for name in [n for n in t.caches if isinstance(n, str) and n.startswith(p)]:
        del t.caches[name]
    _let_go(t.dacts, [n for n in t.dacts if n.startswith(p) and n not in keep
                      and n not in (p + "in", p + "out")], "actgrad", t.seen)
    if t.held is not None:
        parallel.settle()   # the block's weight gradients, made on the other core, are done
        _let_go(t.grads, [n for n in t.grads if n.startswith(p) and n not in t.held],
                "grad", t.seen)


def first_nonfinite(arrays: dict) -> str | None:
    """The name of the first array holding a NaN or an infinity, or None.

    Two -infs are allowed, because they are the true values: a hidden key's attention score, and
    the gradient d loss / d probs = -1 / (N P) of a target whose probability underflowed to 0
    (logit gap above ~745 in float64, ~88 in float32), whose true size is beyond float range.
    """
    for name, value in arrays.items():
        if hasattr(value, "finite"):   # a streamed run's summary of what it dropped
            if not value.finite:
                return name
            continue
        neginf_allowed = name.endswith("attn.scores") or name == "probs"
        # First one pass with no temporary array: a NaN or a +inf makes the sum NaN or +inf,
        # so a finite sum (or -inf, where -inf is allowed) clears the array. Any other sum
        # (including finite values whose sum overflows) gets the entry-by-entry look.
        with np.errstate(over="ignore", invalid="ignore"):
            total = value.sum()
        if np.isfinite(total) or (neginf_allowed and total == -np.inf):
            continue
        if neginf_allowed:
            value = np.where(np.isneginf(value), 0.0, value)
        if not np.all(np.isfinite(value)):
            return name
    return None
