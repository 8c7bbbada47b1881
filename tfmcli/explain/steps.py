"""One attention head, step by step, as seeds 000 and 002 teach it.

Each step is a named array with the formula that made it, ready to be rendered in order. The
arrays are recomputed here from the head's inputs (the model's own ``attn.q/k/v`` must agree,
and the tests check that they do).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import central_differences
from tfmcli.engine import ops
from tfmcli.engine.blocks import normalise, rope_for
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, check_within, mask_for
from tfmcli.engine.positional import alibi_distances, alibi_slopes, slope_name


class Step(NamedTuple):
    name: str
    formula: str
    value: np.ndarray
    mask: np.ndarray | None = None   # True = may attend: hidden cells are drawn as "·"


CAP_FORMULA = "{0:g} tanh(scaled / {0:g}): Gemma 2's soft cap, never past ±{0:g}"
ROPE_FORMULA = "RoPE: {0} cos + rotate_half({0}) sin, row t turned by position t's angles"
PARTIAL = ", its first {0} columns only (rotary_dim; the other {1} pass unturned)"
# Qwen3's norms of each head's queries and keys: {0} the array, {1} the norm's parameters
NORM_FORMULA = {True: "RMSNorm of each row: {0} / sqrt(mean({0}^2) + eps) * {1}.gamma",
                False: "layer norm of each row: ({0} - mean) / sqrt(var + eps) * {1}.gamma"}


def norm_formula(cfg: Config) -> str:
    """NORM_FORMULA of the model's norms, with ``+ {1}.beta`` when they add one."""
    return NORM_FORMULA[cfg.rms_norm] + (" + {1}.beta" if cfg.norm_biased else "")
NORM_BACK_FORMULA = {True: "back through {1}: rstd (g - xhat mean(g xhat)), g = {0} * {1}.gamma",
                     False: "back through {1}: rstd (g - mean(g) - xhat mean(g xhat)), g = {0} "
                            "* {1}.gamma"}


def scored(cfg: Config, which: str) -> str:
    """The activation whose rows the scores multiply, for ``which`` "q" or "k": turned by RoPE
    (``attn.q_rot``), else normalised (``attn.q_norm.out``), else ``attn.q``."""
    if cfg.pe == "rope":
        return which + "_rot"
    return which + "_norm.out" if cfg.qk_norm else which


def scale_name(cfg: Config) -> str:
    """What the scores are multiplied by, as the formulas name it: '1/sqrt(d_head)', or
    'attn_scale' when the Config gives its own (``Config.attn_scale``)."""
    return "1/sqrt(d_head)" if cfg.attn_scale is None else "attn_scale"


def head_steps(x, W_Q, b_Q, W_K, b_K, W_V, b_V, mask, scale, rope=None, norms=None, cap=None,
               scale_by="1/sqrt(d_head)", slope=None):
    """The steps of one head on one sequence.

    x: (T, d); W_*: (d, d_head); b_*: (d_head,), or None in a model without biases; mask:
    (T, T) bool, True = may attend; rope: None, or RoPE's (cos, sin) tables (T, d_head), which
    turn Q and K before the scores; norms: None, or (Q's norm, K's norm, its formula), the
    functions of a (T, d_head) array that normalise Q and K first (Qwen3's q_norm, k_norm);
    cap: None, or the scores' soft cap C (Gemma 2's), ``C tanh(scaled / C)`` before the mask.
    scale_by: what ``scale`` is, for the formulas (``scale_name``). slope: None, or the
    head's ALiBi slope m: ``-m (i - j)`` added to the scaled scores, before the cap.
    """
    steps = [Step("X", "input to attention, one row of the batch", x)]
    for name, W, b in (("Q", W_Q, b_Q), ("K", W_K, b_K), ("V", W_V, b_V)):
        if b is None:
            steps.append(Step(name, f"{name} = X W_{name}", x @ W))     # (T, d_head)
        else:
            steps.append(Step(name, f"{name} = X W_{name} + b_{name}", x @ W + b))
    q, k, v = (step.value for step in steps[1:])
    Q, K = "Q", "K"   # the names of what the scores multiply, so far
    if norms is not None:
        norm_q, norm_k, formula = norms
        q, k = norm_q(q), norm_k(k)
        steps += [Step("Q_norm", formula.format("Q", "q_norm"), q),
                  Step("K_norm", formula.format("K", "k_norm"), k)]
        Q, K = "Q_norm", "K_norm"
    if rope is not None:
        n, d_head = rope[0].shape[-1], q.shape[-1]
        partial = PARTIAL.format(n, d_head - n) if n < d_head else ""
        q, k = ops.rope_forward(q, *rope), ops.rope_forward(k, *rope)
        steps += [Step("Q_rot", ROPE_FORMULA.format(Q) + partial, q),
                  Step("K_rot", ROPE_FORMULA.format(K) + partial, k)]
        Q, K = "Q_rot", "K_rot"
    product = f"{Q} {K}^T"
    scores = q @ k.T                                             # (T, T)
    scaled = scores * scale
    steps += [Step("scores", product, scores),
              Step("scaled scores", (f"{product} / sqrt(d_head)" if scale_by == "1/sqrt(d_head)"
                                     else f"{product} x {scale_by}")
                   + f" = {product} x {scale:.6g}", scaled)]
    if slope is not None:   # ALiBi: the further behind the key, the lower its score
        T = scaled.shape[0]
        scaled = scaled - slope * alibi_distances(T, scaled.dtype)
        steps.append(Step("ALiBi scores", f"scaled scores - m (i - j), m = {slope_name(slope)}: "
                          f"ALiBi's penalty for distance (query i, key j)", scaled))
    if cap is not None:   # squashed into (-cap, cap) before the mask
        scaled = ops.softcap_forward(scaled, cap)
        steps.append(Step("capped scores", CAP_FORMULA.format(cap), scaled))
    masked = np.where(mask, scaled, -np.inf)
    pattern, _ = ops.softmax_forward(masked)
    context = pattern @ v                                        # (T, d_head)
    return steps + [
        Step("masked scores", "-inf where the mask hides a key", masked),
        Step("softmax", "softmax over keys, row max subtracted; · = hidden (exactly 0)",
             pattern, mask),
        Step("context", "softmax @ V", context),
    ]


def head_slope(cfg: Config, head: int) -> float | None:
    """Head ``head``'s ALiBi slope, or None when the model does not add ALiBi."""
    return None if cfg.pe != "alibi" else float(alibi_slopes(cfg.heads)[head])


def check_head(fwd: Forward, cfg: Config, block: int, head: int, row: int, t: int | None = None):
    """A ``ValueError`` for a block, head, row or query the run does not have (NumPy would read
    row -1 as the last, and a head past the last as an empty slice)."""
    B, T = fwd.inputs.tokens.shape
    check_within(None, block=(block, cfg.layers), head=(head, cfg.heads), row=(row, B),
                 **({"query": (t, T)} if t is not None else {}))


def model_head_steps(params: dict, fwd: Forward, cfg: Config, block: int, head: int, row: int):
    """The steps of head ``head`` of block ``block`` for batch row ``row`` of a model run."""
    check_head(fwd, cfg, block, head, row)
    p = f"blocks.{block}."
    x = fwd.acts[p + ("ln1.out" if cfg.norm == "pre" else "in")][row]     # (T, d)
    weights = []
    for w in "QKV":   # grouped: the head reads the keys and values of the head it shares
        h = head if w == "Q" else head // cfg.group
        cols = slice(h * cfg.d_head, (h + 1) * cfg.d_head)
        bias = params.get(p + f"attn.b_{w}")   # None in a model without biases
        weights += [params[p + f"attn.W_{w}"][:, cols], None if bias is None else bias[cols]]
    T = fwd.inputs.tokens.shape[1]
    mask = mask_for(cfg, fwd.inputs.lengths, T, block)[row]
    norms = None
    if cfg.qk_norm:
        norms = (lambda a: normalise(a, params, p + "attn.q_norm", cfg),
                 lambda a: normalise(a, params, p + "attn.k_norm", cfg), norm_formula(cfg))
    steps = head_steps(x, *weights, mask, cfg.score_scale, rope=rope_for(cfg, T, block),
                       norms=norms, cap=cfg.attn_softcap, scale_by=scale_name(cfg),
                       slope=head_slope(cfg, head))
    source = "LN1 output" if cfg.norm == "pre" else "block input"
    steps[0] = steps[0]._replace(formula=f"{source} of block {block}, batch row {row}")
    if cfg.group > 1:   # K and V are a shared head's: say whose
        shared = f" (key head {head // cfg.group}, shared by query heads {sharing(cfg, head)})"
        steps = [s._replace(formula=s.formula + shared) if s.name in ("K", "V") else s
                 for s in steps]
    return steps


def sharing(cfg: Config, head: int) -> str:
    """The query heads that share head ``head``'s keys and values, as 'a..b' (grouped)."""
    first = head // cfg.group * cfg.group
    return f"{first}..{first + cfg.group - 1}"


# The integer worked example of seed 002 (three inputs of width 4, d_k = 3).
ILLUSTRATED = {
    "X": np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=np.float64),
    "W_Q": np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=np.float64),
    "W_K": np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=np.float64),
    "W_V": np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=np.float64),
}


def illustrated_steps(scale: float):
    """Seed 002's example with no mask and no biases; ``scale=1`` is what the note's code does."""
    X = ILLUSTRATED["X"]
    zero = np.zeros(3)
    mask = np.ones((3, 3), dtype=bool)
    return head_steps(X, ILLUSTRATED["W_Q"], zero, ILLUSTRATED["W_K"], zero,
                      ILLUSTRATED["W_V"], zero, mask, scale)


class QueryExplained(NamedTuple):
    """One row of one head's attention, every number of it (``tfm attn --query``)."""

    t: int                # the query's position
    q: np.ndarray         # (d_head,)
    k: np.ndarray         # (T, d_head) every key
    products: np.ndarray  # (T, d_head) q_i * k_i; each row sums to that key's score
    scores: np.ndarray    # (T,) q . k
    scale: float          # 1 / sqrt(d_head), or the Config's attn_scale
    visible: np.ndarray   # (T,) bool: the mask of this query's row
    weights: np.ndarray   # (T,) the softmax (0 where hidden)
    v: np.ndarray         # (T, d_head)
    weighted: np.ndarray  # (T, d_head) weights[s] * v[s]; the rows sum to the context
    context: np.ndarray   # (d_head,)
    scaled: np.ndarray    # (T,) scores * scale, before the mask
    capped: np.ndarray    # (T,) the scaled scores (plus ALiBi's bias) soft-capped
    #                       (attn_softcap): the softmax's input before the mask; without a cap,
    #                       the scaled (and biased) scores themselves
    bias: np.ndarray | None = None   # (T,) ALiBi's -m (t - j) added to the scaled scores, or None
    biased: np.ndarray | None = None  # (T,) scaled + bias, the cap's input, or None without ALiBi


def explain_query(fwd: Forward, cfg: Config, block: int, head: int, row: int, t: int):
    """Query ``t`` of head ``head`` in block ``block``, batch row ``row``, from the model's own
    q, k and v (the ``attn.q/k/v`` activations; under RoPE the turned ``attn.q_rot/k_rot``,
    with qk_norm alone the normalised ``attn.q_norm.out/k_norm.out``), recomputed product by
    product."""
    check_head(fwd, cfg, block, head, row, t)
    p = f"blocks.{block}.attn."
    q = fwd.acts[p + scored(cfg, "q")][row, head, t]             # (d_head,)
    k = fwd.acts[p + scored(cfg, "k")][row, head // cfg.group]   # (T, d_head): grouped, shared
    v = fwd.acts[p + "v"][row, head // cfg.group]
    T = k.shape[0]
    visible = mask_for(cfg, fwd.inputs.lengths, T, block)[row, t]         # (T,)
    products = q[None, :] * k                                    # (T, d_head)
    scores = products.sum(axis=-1)                               # (T,)
    scale = cfg.score_scale
    scaled = scores * scale
    slope = head_slope(cfg, head)
    bias = biased = None
    if slope is not None:   # ALiBi: - m (t - j), query t's row
        bias = -slope * (t - np.arange(T)).astype(scaled.dtype)
        biased = scaled + bias
    capped = capped_scores(scaled if biased is None else biased, cfg)
    weights, _ = ops.softmax_forward(np.where(visible, capped, -np.inf))
    weighted = weights[:, None] * v                              # (T, d_head)
    return QueryExplained(t, q, k, products, scores, scale, visible, weights, v, weighted,
                          weighted.sum(axis=0), scaled, capped, bias, biased)


def capped_scores(scaled, cfg: Config):
    """The scaled scores soft-capped at ``cfg.attn_softcap``; themselves without a cap."""
    return scaled if cfg.attn_softcap is None else ops.softcap_forward(scaled, cfg.attn_softcap)


# ---------------------------------------------------------------- backward


def head_backward_steps(dcontext, q, k, v, pattern, mask, scale, rope=None, norms=None,
                        cap=None, scale_by="1/sqrt(d_head)"):
    """The backward of one head on one sequence, from the gradient of its context: where seed
    003 stops (at dV), on through the softmax to dQ and dK.

    dcontext, q, k, v: (T, d_head); pattern: (T, T) the softmax; mask: (T, T) bool; rope:
    None, or RoPE's (cos, sin) tables, when q and k are the turned ones: then dQ_rot and
    dK_rot, and the turn back to dQ and dK; norms: None, or (Q's norm's backward, K's, its
    formula), when q and k were normalised first: then the gradients so far are dQ_norm and
    dK_norm, and the norms' backward gives dQ and dK; cap: None, or the scores' soft cap C:
    then the softmax's backward gives dcapped, and the cap's slope ``1 - (capped / C)^2``
    dscaled.
    """
    Q, K = ("Q_rot", "K_rot") if rope is not None else ("Q_norm", "K_norm") if norms else ("Q", "K")
    dpattern = dcontext @ v.T                                    # (T, T)
    dv = pattern.T @ dcontext                                    # (T, d_head)
    row_sums = (dpattern * pattern).sum(axis=-1, keepdims=True)  # (T, 1)
    dsoftmax_in = pattern * (dpattern - row_sums)                # 0 on hidden keys
    softmax_back = "softmax * (dsoftmax - rowsum(softmax * dsoftmax)); · = hidden (exactly 0)"
    steps = [
        Step("dcontext", "d loss / d context, from the backward pass", dcontext),
        Step("dsoftmax", "dcontext @ V^T (every key; a hidden key's weight is 0, so it goes "
             "no further)", dpattern),
        Step("dV", "softmax^T @ dcontext", dv),
    ]
    if cap is None:
        dscaled = dsoftmax_in
        steps.append(Step("dscaled scores", softmax_back, dscaled, mask))
    else:   # the softmax took the capped scores: back through the cap by its slope
        capped = ops.softcap_forward(q @ k.T * scale, cap)
        dscaled = dsoftmax_in * ops.softcap_slope(capped, cap)
        steps += [Step("dcapped scores", softmax_back, dsoftmax_in, mask),
                  Step("dscaled scores", f"dcapped scores x (1 - (capped / {cap:g})^2), the "
                       f"cap's slope", dscaled, mask)]
    dq = dscaled @ k * scale
    dk = dscaled.T @ q * scale
    steps += [
        Step("d" + Q, f"dscaled scores @ {K} x {scale:.6g} ({scale_by})", dq),
        Step("d" + K, f"dscaled scores^T @ {Q} x {scale:.6g} ({scale_by})", dk),
    ]
    if rope is not None:   # q and k were turned: the turn back gives the gradients before it
        Q, K = ("Q_norm", "K_norm") if norms else ("Q", "K")
        dq, dk = ops.rope_backward(dq, *rope), ops.rope_backward(dk, *rope)
        steps += [Step("d" + Q, "the turn back: dQ_rot cos - rotate_half(dQ_rot) sin", dq),
                  Step("d" + K, "the turn back: dK_rot cos - rotate_half(dK_rot) sin", dk)]
    if norms is not None:   # q and k were normalised: back through each head's norms
        back_q, back_k, formula = norms
        steps += [Step("dQ", formula.format("dQ_norm", "q_norm"), back_q(dq)),
                  Step("dK", formula.format("dK_norm", "k_norm"), back_k(dk))]
    return steps


def model_head_backward_steps(fwd: Forward, dcontext_all: np.ndarray, cfg: Config, block: int,
                              head: int, row: int):
    """head_backward_steps of a model run: ``dcontext_all`` is the gradient of the loss with
    respect to the block's merged context (``grads.acts['blocks.i.attn.context']``, (B, T, d)).
    The head's q, k, v and softmax are the model's own (q and k turned, under RoPE)."""
    check_head(fwd, cfg, block, head, row)
    p = f"blocks.{block}.attn."
    shared = head // cfg.group   # grouped: the key and value head this head reads
    q, k, v, pattern = (fwd.acts[p + name][row, h] for name, h in (
        (scored(cfg, "q"), head), (scored(cfg, "k"), shared), ("v", shared), ("pattern", head)))
    dcontext = dcontext_all[row, :, head * cfg.d_head:(head + 1) * cfg.d_head]
    T = fwd.inputs.tokens.shape[1]
    mask = mask_for(cfg, fwd.inputs.lengths, T, block)[row]
    norms = None
    if cfg.qk_norm:   # each norm's backward, from the forward's own cache of this head
        back = ops.rms_norm_backward if cfg.rms_norm else ops.layer_norm_backward

        def norm_backward(name, h):
            xhat, rstd, gamma = fwd.caches[p + name]
            return lambda d: back(d, ops.LayerNormCache(xhat[row, h], rstd[row, h], gamma))[0]

        norms = (norm_backward("q_norm", head), norm_backward("k_norm", shared),
                 NORM_BACK_FORMULA[cfg.rms_norm])
    return head_backward_steps(dcontext, q, k, v, pattern, mask, cfg.score_scale,
                               rope_for(cfg, T, block), norms, cfg.attn_softcap, scale_name(cfg))


class QueryBackward(NamedTuple):
    """The backward of one row of one head's attention (``tfm attn --query t --backward``),
    in float64 whatever the model's dtype."""

    dcontext: np.ndarray   # (d_head,) d loss / d context row, from the backward pass
    dproducts: np.ndarray  # (T, d_head) dcontext_i * v[s]_i; each row sums to dweights[s]
    dweights: np.ndarray   # (T,) dcontext . v[s]: d loss / d weight of key s
    weighted_sum: float    # sum over keys of weights * dweights
    dweights_centred: np.ndarray  # (T,) dweights - weighted_sum
    dscaled: np.ndarray    # (T,) weights * (dweights - weighted_sum), times the slope with a
    #                        cap: d loss / d scaled score
    dscores: np.ndarray    # (T,) dscaled * scale: d loss / d (q . k)
    dq_parts: np.ndarray   # (T, d_head) dscores[s] * k[s]; the rows sum to dq
    dq: np.ndarray         # (d_head,)
    dk_share: np.ndarray   # (T, d_head) dscores[s] * q: this query's part of each key's dk
    dv_share: np.ndarray   # (T, d_head) weights[s] * dcontext: its part of each key's dv
    numeric_dq: np.ndarray  # central differences of sum(dcontext * context) in q
    dq_turned_back: np.ndarray | None = None   # RoPE: the gradient of q before its turn
    slope: np.ndarray | None = None   # (T,) a cap's 1 - (capped / C)^2; None without a cap
    dcapped: np.ndarray | None = None  # (T,) weights * (dweights - weighted_sum): d loss / d
    #                                    capped score, with a cap; None without


def explain_query_backward(fwd: Forward, dcontext_all: np.ndarray, cfg: Config, block: int,
                           head: int, row: int, t: int, step: float = 1e-6) -> QueryBackward:
    """The backward of query ``t`` (see explain_query), from ``dcontext_all`` as in
    model_head_backward_steps. dq is checked against central differences of the one thing q
    changes, ``sum(dcontext * context)``, not against the formula that made it."""
    x = explain_query(fwd, cfg, block, head, row, t)
    k, v, weights = (a.astype(np.float64) for a in (x.k, x.v, x.weights))
    q = x.q.astype(np.float64)
    dcontext = dcontext_all[row, t, head * cfg.d_head:(head + 1) * cfg.d_head].astype(np.float64)
    dproducts = dcontext[None, :] * v                            # (T, d_head)
    dweights = dproducts.sum(axis=-1)                            # (T,)
    weighted_sum = float((weights * dweights).sum())
    dweights_centred = dweights - weighted_sum
    dscaled = weights * dweights_centred                         # 0 where hidden
    slope = dcapped = None
    if cfg.attn_softcap is not None:   # that is the capped score's: back through the cap
        slope = ops.softcap_slope(x.capped.astype(np.float64), cfg.attn_softcap)
        dcapped, dscaled = dscaled, dscaled * slope
    dscores = dscaled * x.scale
    dq_parts = dscores[:, None] * k                              # (T, d_head)

    def contracted(query):   # sum(dcontext * context(query)): its gradient in q is dq
        scaled = (k @ query) * x.scale if x.bias is None else (k @ query) * x.scale + x.bias
        scaled = np.where(x.visible, capped_scores(scaled, cfg), -np.inf)
        w, _ = ops.softmax_forward(scaled)
        return float(dcontext @ (w @ v))

    numeric = central_differences(contracted, q, step)
    dq = dq_parts.sum(axis=0)
    rope = rope_for(
        cfg, len(k), block
    )  # under RoPE q is the turned one: turned back, its own gradient
    turned_back = None if rope is None else ops.rope_backward(dq, rope[0][t], rope[1][t])
    return QueryBackward(dcontext, dproducts, dweights, weighted_sum, dweights_centred, dscaled,
                         dscores, dq_parts, dq, dscores[:, None] * q[None, :],
                         weights[:, None] * dcontext[None, :], numeric, turned_back, slope,
                         dcapped)
