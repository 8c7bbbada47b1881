"""The embedding and the positions at one position, number by number, forward and backward
(``tfm embed``).

The forward is a lookup and a sum: ``x0 = W_E[id] + PE[t]``, with PE the sinusoidal table's row
(``PE[t, 2i] = sin(t / 10000^(2i/d))``, ``PE[t, 2i+1] = cos(...)``), the learned ``W_pos[t]``, or
nothing (seed 004 adds them; no seed derives their backward). The lookup's gradient is a
scatter-add: ``dW_E[id]`` is the sum of ``dx0`` over every position of the batch that holds the
token, and a head tied to the embedding adds its own part, ``sum over b, t of dlogits[b, t, id]
h[b, t]`` (with ``logit_softcap``, dlogits times the cap's slope). Likewise ``dW_pos[t]`` sums
``dx0`` at position t over the batch. With ``embed_scale`` the row is multiplied by
``sqrt(d_model)`` first, ``x0 = sqrt(d) W_E[id] + PE[t]``, and so is the lookup's part of its
gradient.
This lays out each term and checks the sums against the backward pass and against central
differences of the loss itself (the whole model, run again in float64).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import central_differences
from tfmcli.engine import ops
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, Gradients, check_within, unchecked_forward
from tfmcli.engine.positional import angles, sinusoidal
from tfmcli.explain.loss import input_name as head_input


class EmbedExplained(NamedTuple):
    token: int                   # the id at (row, t)
    w_e: np.ndarray              # (d,) W_E[token]
    angle: np.ndarray | None     # (d,) t / 10000^(2i/d), column 2i and 2i+1; sinusoidal only
    pe: np.ndarray | None        # (d,) what is added at t: sin/cos of angle, or W_pos[t]
    x0: np.ndarray               # (d,) scale w_e + pe: the first block's input
    occurrences: list            # [(b, t), ...] every position that holds the token, in order
    dx0: np.ndarray              # (n, d) the backward pass's gradient of x0 at each of them
    embedding_part: np.ndarray   # (d,) dx0 summed over the occurrences, times scale
    head_part: np.ndarray | None  # (d,) tied: sum over b, t of dlogits[b, t, token] h[b, t]
    dw_e: np.ndarray             # (d,) embedding_part (+ head_part)
    dx0_at_t: np.ndarray | None  # (B, d) learned: dx0 at position t in every batch row
    dw_pos: np.ndarray | None    # (d,) learned: dx0_at_t summed over the batch
    checked: np.ndarray          # the entries of the row checked by central differences
    numeric_dw_e: np.ndarray     # (len(checked),) d loss / d W_E[token, j] by central differences
    numeric_dw_pos: np.ndarray | None  # (len(checked),) the same for W_pos[t, j]; learned only
    scale: float = 1.0           # what the row is multiplied by: sqrt(d) with embed_scale


def explain(params: dict, fwd: Forward, grads: Gradients, cfg: Config, row: int, t: int,
            entries: int = 8, step: float = 1e-6) -> EmbedExplained:
    """The embedding at batch row ``row``, position ``t``, in float64. Central differences run
    the whole model again (in float64) twice per entry, for ``entries`` entries of the row: every
    entry when d is no more, else those with the largest gradient. A row or position the run does
    not have is a ``ValueError``."""
    tokens = fwd.inputs.tokens
    B, T = tokens.shape
    check_within("explain", row=(row, B), position=(t, T))
    d = cfg.d_model
    token = int(tokens[row, t])
    w_e = params["embed.W_E"][token].astype(np.float64)
    angle = pe = None
    if cfg.pe == "sinusoidal":   # the table's row t, beside its angles
        angle, pe = angles(t, d), sinusoidal(t + 1, d)[t]
    elif cfg.pe == "learned":
        pe = params["embed.W_pos"][t].astype(np.float64)
    scale = cfg.embed_factor
    x0 = scale * w_e if pe is None else scale * w_e + pe

    dx = grads.acts["embed"].astype(np.float64)                              # (B, T, d)
    occurrences = [(int(b), int(s)) for b, s in np.argwhere(tokens == token)]
    dx0 = np.array([dx[b, s] for b, s in occurrences])
    embedding_part = scale * dx0.sum(axis=0)
    head_part = None
    dw_e = embedding_part
    if cfg.tied_head:
        dlogits = grads.acts["logits"][..., token].astype(np.float64)          # (B, T)
        if cfg.logit_softcap is not None:   # the head's own gradient: through the cap's slope
            logits = fwd.acts["logits"][..., token].astype(np.float64)
            dlogits = dlogits * ops.softcap_slope(logits, cfg.logit_softcap)
        h = fwd.acts[head_input(cfg)].astype(np.float64)                       # (B, T, d)
        head_part = np.einsum("bt,btd->d", dlogits, h)
        dw_e = embedding_part + head_part
    dx0_at_t = dw_pos = None
    if cfg.pe == "learned":
        dx0_at_t = dx[:, t]
        dw_pos = dx0_at_t.sum(axis=0)

    checked = np.sort(np.argsort(-np.abs(dw_e), kind="stable")[:entries])
    # float64 throughout; only the two rows nudged need copies of their own
    work = {name: value.astype(np.float64, copy=name in ("embed.W_E", "embed.W_pos"))
            for name, value in params.items()}
    cfg64 = cfg.replace(dtype="float64")

    def numeric(name, index):   # d loss / d params[name][index, checked], the rest held
        weights = work[name][index]

        def loss_of(values):
            kept = weights[checked].copy()
            weights[checked] = values
            try:
                return unchecked_forward(work, fwd.inputs, cfg64,
                                         plan=fwd.caches.get("plan")).loss   # (changed alike)
            finally:
                weights[checked] = kept

        return central_differences(loss_of, weights[checked].copy(), step)

    numeric_dw_e = numeric("embed.W_E", token)
    numeric_dw_pos = numeric("embed.W_pos", t) if cfg.pe == "learned" else None
    return EmbedExplained(token, w_e, angle, pe, x0, occurrences, dx0, embedding_part,
                          head_part, dw_e, dx0_at_t, dw_pos, checked, numeric_dw_e,
                          numeric_dw_pos, scale)
