"""The logit lens: read the residual stream after each block as if it were the last.

For the embedding (the first block's input) and each block's output, apply the final layer
norm (Pre-LN; Post-LN blocks end normalised and have none) and the head, and keep the top-k
next tokens per position. The last row is the model's own prediction.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.engine import ops
from tfmcli.engine.blocks import normalise
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, head_weights


class LensRow(NamedTuple):
    name: str            # "embed", "block 0", ...
    stream: str          # the activation read: "blocks.0.in", "blocks.0.out", ...
    logits: np.ndarray   # (T, V), a view of one array of every stream's logits
    top: np.ndarray      # (T, k) token ids, most likely first
    probs: np.ndarray    # (T, k) their probabilities


def logit_lens(params: dict, fwd: Forward, cfg: Config, row: int, k: int = 3) -> list[LensRow]:
    """One LensRow per residual stream of batch row ``row``, embedding first.

    ``row`` lies in ``0..B-1`` and ``k`` is at least 1: NumPy would read row ``-1`` as the last
    row, and a lens of the wrong row reads as a right one.
    """
    B = fwd.acts["blocks.0.in"].shape[0]
    if not 0 <= row < B:
        raise ValueError(f"logit_lens: row={row}; it must lie in 0..{B - 1} (batch rows)")
    if k < 1:
        raise ValueError(f"logit_lens: k={k}; it must be at least 1")
    streams = [("embed", "blocks.0.in")] + [(f"block {i}", f"blocks.{i}.out")
                                              for i in range(cfg.layers)]
    xs = [fwd.acts[stream][row] for _, stream in streams]           # each (T, d)
    if cfg.norm == "pre":
        xs = [normalise(x, params, "ln_f", cfg) for x in xs]
    # the head's product on every stream at once: W_U (d x V) read once, not once a stream
    # (GPT-2 small's 309 MB, 13 streams of 32 tokens: the lens took 306-319 ms, from 470-745)
    every = ops.linear_forward(np.stack(xs), *head_weights(params, cfg))[0]  # (streams, T, V)
    rows = []
    for (name, stream), logits in zip(streams, every):
        if cfg.logit_softcap is not None:   # a stream at a time: its temporaries, not all's
            logits[...] = ops.softcap_forward(logits, cfg.logit_softcap)
        probs, _ = ops.softmax_forward(logits)
        top = top_k(probs, k)                                       # (T, k)
        rows.append(LensRow(name, stream, logits, top, np.take_along_axis(probs, top, -1)))
    return rows


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's ``k`` largest entries, largest first and equal ones by id:
    ``np.argsort(-probs, axis=-1, kind="stable")[:, :k]`` without sorting whole rows. Each
    row's k-th largest value is found by partition, and only the entries at least that large
    (the k, and any equal to the k-th) are sorted. On GPT-2's 50,257 tokens, 32 positions and
    13 streams, the full sorts took 1.9 s of ``tfm lens``."""
    T, V = probs.shape
    k = min(k, V)
    if k * 8 >= V or np.isnan(probs).any():   # short rows, or NaN (sorted last): sort them all
        return np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    minus = -probs
    kth = np.partition(minus, k - 1, axis=-1)[:, k - 1:k]           # (T, 1): minus the k-th largest
    rows, ids = np.nonzero(minus <= kth)                            # row by row, each by id
    order = np.lexsort((ids, minus[rows, ids], rows))               # by row, value, then id
    rows, ids = rows[order], ids[order]
    starts = np.searchsorted(rows, np.arange(T))                    # each row has k or more
    return ids[starts[:, None] + np.arange(k)]
