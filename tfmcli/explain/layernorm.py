"""One layer norm at one position, number by number, forward and backward (``tfm ln``).

Seed 003 derived layer norm's backward by hand and got it wrong three ways; this recomputes
every intermediate of one row from the model's own input to that layer norm, so that each
number a learner derives can be checked: the forward from x to y, the backward from the
upstream gradient dy to dx. The results are checked against the model (its own output of the
layer norm) and against central differences (dx), not against the formulas that made them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import central_differences
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, check_within


def names(cfg: Config) -> list[str]:
    """Every layer norm of the model, in forward order: ('ln_embed',) 'blocks.0.ln1', ...,
    'ln_f' (with
    ``sandwich_norm``, 'blocks.0.ln1_post' after ln1 and 'blocks.0.ln2_post' after ln2; with
    ``shared_norm`` no ln2)."""
    each = (("ln1", "ln1_post", "ln2", "ln2_post") if cfg.sandwich_norm
            else ("ln1",) if cfg.shared_norm else ("ln1", "ln2"))
    blocks = [f"blocks.{i}.{ln}" for i in range(cfg.layers) for ln in each]
    return (["ln_embed"] if cfg.embed_norm else []) + blocks + (["ln_f"] if cfg.norm == "pre"
                                                                else [])


def input_name(cfg: Config, name: str) -> str:
    """The activation a layer norm reads. Pre-LN: ln1 the block's input, ln2 the residual
    after attention (a parallel block's ln2 the block's input too), ln_f the last block's
    output; Post-LN: each the residual sum before it. A sandwich's ln1_post reads attention's
    output, ln2_post the FFN's."""
    if name == "ln_f":
        return f"blocks.{cfg.layers - 1}.out"
    if name == "ln_embed":   # BLOOM's: the token's embedding
        return "embed"
    block, ln = name.rsplit(".", 1)
    if ln.endswith("_post"):
        return f"{block}.attn.out" if ln == "ln1_post" else f"{block}.ffn.out"
    if cfg.norm == "pre":
        return f"{block}.in" if ln == "ln1" or cfg.parallel_residual else f"{block}.resid1"
    return f"{block}.resid1" if ln == "ln1" else f"{block}.resid2"


class LayerNormExplained(NamedTuple):
    """With RMSNorm (``rms``) no mean is taken out: ``mean`` and ``mean_dxhat`` are 0,
    ``centred`` is x, ``dxhat_centred`` dxhat, ``var`` the mean square, ``beta`` 0. A layer
    norm without beta (``norm_bias`` false, ``has_beta`` false) has ``beta`` 0 too."""
    x: np.ndarray          # (d,) the input row
    mean: float            # sum(x) / d
    centred: np.ndarray    # x - mean
    var: float             # sum(centred^2) / d (biased, as in the model)
    std: float             # sqrt(var + eps)
    xhat: np.ndarray       # centred / std
    gamma: np.ndarray
    beta: np.ndarray
    y: np.ndarray          # gamma * xhat + beta
    dy: np.ndarray         # d loss / d y, from the backward pass
    dxhat: np.ndarray      # dy * gamma
    mean_dxhat: float      # sum(dxhat) / d
    mean_dxhat_xhat: float  # sum(dxhat * xhat) / d
    dxhat_centred: np.ndarray  # dxhat - mean_dxhat
    xhat_scaled: np.ndarray    # xhat * mean_dxhat_xhat
    dx: np.ndarray         # (dxhat_centred - xhat_scaled) / std
    numeric_dx: np.ndarray  # central differences of sum(dy * LN(x)) in x
    rms: bool = False      # RMSNorm: y = gamma * x / sqrt(mean(x^2) + eps)
    has_beta: bool = True  # the norm adds beta (layer norm with norm_bias)


def explain(params: dict, fwd: Forward, dy_all: np.ndarray, cfg: Config, name: str, row: int,
            t: int, step: float = 1e-6) -> LayerNormExplained:
    """Layer norm ``name`` at batch row ``row``, position ``t``; ``dy_all`` is the gradient of
    the loss with respect to its output (``grads.acts[name + '.out']``). A name, row or
    position the run does not have is a ``ValueError`` (NumPy would read row -1 as the last)."""
    if name not in names(cfg):
        raise ValueError(f"explain: no layer norm {name!r}; this model has "
                         f"{', '.join(names(cfg))}")
    B, T = fwd.inputs.tokens.shape
    check_within("explain", row=(row, B), position=(t, T))
    x = fwd.acts[input_name(cfg, name)][row, t].astype(np.float64)
    gamma = params[name + ".gamma"].astype(np.float64)
    d, rms = x.size, cfg.rms_norm
    biased = cfg.norm_biased
    beta = params[name + ".beta"].astype(np.float64) if biased else np.zeros(d)
    mean = 0.0 if rms else float(x.sum() / d)
    centred = x - mean
    var = float((centred * centred).sum() / d)
    std = float(np.sqrt(var + cfg.eps))
    xhat = centred / std
    dy = dy_all[row, t].astype(np.float64)
    dxhat = dy * gamma
    mean_dxhat = 0.0 if rms else float(dxhat.sum() / d)
    mean_dxhat_xhat = float((dxhat * xhat).sum() / d)
    dxhat_centred, xhat_scaled = dxhat - mean_dxhat, xhat * mean_dxhat_xhat
    dx = (dxhat_centred - xhat_scaled) / std

    def contracted(row_x):   # sum(dy * LN(row_x)): its gradient in x is dx
        c = row_x if rms else row_x - row_x.mean()
        return float(np.dot(dy, gamma * c / np.sqrt((c * c).mean() + cfg.eps) + beta))

    return LayerNormExplained(x, mean, centred, var, std, xhat, gamma, beta,
                              gamma * xhat + beta, dy, dxhat, mean_dxhat, mean_dxhat_xhat,
                              dxhat_centred, xhat_scaled, dx,
                              central_differences(contracted, x, step), rms, biased)
