"""The logit lens: read the residual stream after each block as if it were the last.

For the embedding (the first block's input) and each block's output, apply the final layer
norm (Pre-LN; Post-LN blocks end normalised and have none) and the head, and keep the top-k
next tokens per position. The last row is the model's own prediction.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli import ops
from tfmcli.config import Config
from tfmcli.model import Forward, head_weights


class LensRow(NamedTuple):
    name: str            # "embed", "block 0", ...
    stream: str          # the activation read: "blocks.0.in", "blocks.0.out", ...
    logits: np.ndarray   # (T, V)
    top: np.ndarray      # (T, k) token ids, most likely first
    probs: np.ndarray    # (T, k) their probabilities


def logit_lens(params: dict, fwd: Forward, cfg: Config, row: int, k: int = 3) -> list[LensRow]:
    """One LensRow per residual stream of batch row ``row``, embedding first."""
    streams = [("embed", "blocks.0.in")] + [(f"block {i}", f"blocks.{i}.out")
                                              for i in range(cfg.layers)]
    W_U, b_U = head_weights(params, cfg)
    rows = []
    for name, stream in streams:
        x = fwd.acts[stream][row]                                   # (T, d)
        if cfg.norm == "pre":
            x, _ = ops.layer_norm_forward(x, params["ln_f.gamma"], params["ln_f.beta"], cfg.eps)
        logits, _ = ops.linear_forward(x, W_U, b_U)                 # (T, V)
        probs, _ = ops.softmax_forward(logits)
        k_ = min(k, probs.shape[-1])
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k_]    # (T, k)
        rows.append(LensRow(name, stream, logits, top, np.take_along_axis(probs, top, -1)))
    return rows
