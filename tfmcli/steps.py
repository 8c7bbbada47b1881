"""One attention head, step by step, as seeds 000 and 002 teach it.

Each step is a named array with the formula that made it, ready to be rendered in order. The
arrays are recomputed here from the head's inputs (the model's own ``attn.q/k/v`` must agree,
and the tests check that they do).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tfmcli import ops
from tfmcli.config import Config
from tfmcli.masks import combined_mask
from tfmcli.model import Forward


class Step(NamedTuple):
    name: str
    formula: str
    value: np.ndarray
    mask: np.ndarray | None = None   # True = may attend: hidden cells are drawn as "·"


def head_steps(x, W_Q, b_Q, W_K, b_K, W_V, b_V, mask, scale):
    """The steps of one head on one sequence.

    x: (T, d); W_*: (d, d_head); b_*: (d_head,); mask: (T, T) bool, True = may attend.
    """
    q = x @ W_Q + b_Q                                            # (T, d_head)
    k = x @ W_K + b_K
    v = x @ W_V + b_V
    scores = q @ k.T                                             # (T, T)
    scaled = scores * scale
    masked = np.where(mask, scaled, -np.inf)
    pattern, _ = ops.softmax_forward(masked)
    context = pattern @ v                                        # (T, d_head)
    return [
        Step("X", "input to attention, one row of the batch", x),
        Step("Q", "Q = X W_Q + b_Q", q),
        Step("K", "K = X W_K + b_K", k),
        Step("V", "V = X W_V + b_V", v),
        Step("scores", "Q K^T", scores),
        Step("scaled scores", f"Q K^T / sqrt(d_head) = Q K^T x {scale:.6g}", scaled),
        Step("masked scores", "-inf where the mask hides a key", masked),
        Step("softmax", "softmax over keys, row max subtracted; · = hidden (exactly 0)",
             pattern, mask),
        Step("context", "softmax @ V", context),
    ]


def model_head_steps(params: dict, fwd: Forward, cfg: Config, block: int, head: int, row: int):
    """The steps of head ``head`` of block ``block`` for batch row ``row`` of a model run."""
    p = f"blocks.{block}."
    x = fwd.acts[p + ("ln1.out" if cfg.norm == "pre" else "in")][row]     # (T, d)
    cols = slice(head * cfg.d_head, (head + 1) * cfg.d_head)
    weights = []
    for w in "QKV":
        weights += [params[p + f"attn.W_{w}"][:, cols], params[p + f"attn.b_{w}"][cols]]
    T = fwd.inputs.tokens.shape[1]
    mask = combined_mask(fwd.inputs.lengths, T, cfg.causal)[row]
    steps = head_steps(x, *weights, mask, 1.0 / math.sqrt(cfg.d_head))
    source = "LN1 output" if cfg.norm == "pre" else "block input"
    steps[0] = steps[0]._replace(formula=f"{source} of block {block}, batch row {row}")
    return steps


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
    scale: float          # 1 / sqrt(d_head)
    visible: np.ndarray   # (T,) bool: the mask of this query's row
    weights: np.ndarray   # (T,) the softmax (0 where hidden)
    v: np.ndarray         # (T, d_head)
    weighted: np.ndarray  # (T, d_head) weights[s] * v[s]; the rows sum to the context
    context: np.ndarray   # (d_head,)


def explain_query(fwd: Forward, cfg: Config, block: int, head: int, row: int, t: int):
    """Query ``t`` of head ``head`` in block ``block``, batch row ``row``, from the model's own
    q, k and v (the ``attn.q/k/v`` activations), recomputed product by product."""
    p = f"blocks.{block}.attn."
    q = fwd.acts[p + "q"][row, head, t]                          # (d_head,)
    k = fwd.acts[p + "k"][row, head]                             # (T, d_head)
    v = fwd.acts[p + "v"][row, head]
    T = k.shape[0]
    visible = combined_mask(fwd.inputs.lengths, T, cfg.causal)[row, t]   # (T,)
    products = q[None, :] * k                                    # (T, d_head)
    scores = products.sum(axis=-1)                               # (T,)
    scale = 1.0 / math.sqrt(cfg.d_head)
    weights, _ = ops.softmax_forward(np.where(visible, scores * scale, -np.inf))
    weighted = weights[:, None] * v                              # (T, d_head)
    return QueryExplained(t, q, k, products, scores, scale, visible, weights, v, weighted,
                          weighted.sum(axis=0))
