"""Direct logit attribution (``tfm attribute``): one token's logit at one position as the sum
of what each part of the model wrote into the residual stream.

In a Pre-LN model (or a parallel one) the last residual stream is a sum: the embedding (and the
positions), then each block's attention output (each head's context through its rows of W_O,
and b_O) and its FFN output (its neurons through W_2, and b_2). The logit of token v is
``ln_f(x) . W_U[:, v] + b_U[v]``; with the final norm's scale frozen at the run's value,
``ln_f`` is linear in x: ``gamma (x - mean x) / s + beta``. So each term c adds
``(gamma c / s) . W_U[:, v]``; the centring (``-mean x``), the norm's beta and the head's bias
are terms of their own; the terms add up to the logit.

Post-LN blocks normalise the stream itself, and a sandwich norm normalises each sublayer's
output: their logits are not such sums (a sandwich's sublayers are, its heads are not), and
``attribute`` says what is and is not decomposable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfmcli.engine.model import head_weights


@dataclass
class Attribution:
    """The terms of one logit: ``names`` and ``values`` (largest |value| first), their
    ``total``, the ``logit`` they add up to (before a logit cap: ``capped`` is after it), and
    what could not be split (``note``; empty when every term is there)."""

    token: int
    row: int
    position: int
    names: list[str]
    values: np.ndarray
    logit: float
    capped: float | None = None
    note: str = ""

    @property
    def total(self) -> float:
        return float(self.values.sum())


def undecomposable(cfg) -> str | None:
    """Why this model's logits are not a sum of its parts' (None: they are)."""
    if cfg.norm != "pre":
        return ("a Post-LN block normalises the residual stream itself (x -> LN(x + F(x))): "
                "the last stream is not a sum of what each part wrote, so no term is its own")
    return None


def attribute(params: dict, fwd, cfg, row: int, position: int, token: int) -> Attribution:
    """The logit of ``token`` at ``position`` of batch ``row`` as its terms (``Attribution``).
    Raises ValueError for a model whose logits are not such a sum (``undecomposable``)."""
    why = undecomposable(cfg)
    if why is not None:
        raise ValueError(why)
    acts, b, t = fwd.acts, row, position
    L, H, dh = cfg.layers, cfg.heads, cfg.d_head
    parts: list[tuple[str, np.ndarray]] = []
    if cfg.embed_norm:   # BLOOM's: the stream starts at the normed embedding
        parts.append(("embed (normed)", acts["ln_embed.out"][b, t]))
    else:
        parts.append(("embed", acts["embed"][b, t]))
        if "pe" in acts:
            parts.append(("positions", acts["pe"][t]))
    note = ""
    for i in range(L):
        p = f"blocks.{i}."
        if cfg.sandwich_norm:   # each sublayer's output normed: its heads do not split
            parts += [(f"{p}attn (normed)", acts[p + "ln1_post.out"][b, t]),
                      (f"{p}ffn (normed)", acts[p + "ln2_post.out"][b, t])]
            note = ("a sandwich norm normalises each sublayer's output: a sublayer is a term, "
                    "its heads and biases are not")
            continue
        context = acts[p + "attn.context"][b, t]
        W_O = params[p + "attn.W_O"]
        for h in range(H):
            parts.append((f"{p}attn.head{h}",
                          context[h * dh:(h + 1) * dh] @ W_O[h * dh:(h + 1) * dh]))
        if p + "attn.b_O" in params:
            parts.append((f"{p}attn.b_O", params[p + "attn.b_O"]))
        parts.append((f"{p}ffn (neurons)", acts[p + "ffn.act"][b, t] @ params[p + "ffn.W_2"]))
        if p + "ffn.b_2" in params:
            parts.append((f"{p}ffn.b_2", params[p + "ffn.b_2"]))
    stream = acts[f"blocks.{L - 1}.out"][b, t]
    W_U, _ = head_weights(params, cfg)
    b_U = params["head.b_U"] if cfg.head_bias else None
    column = W_U[:, token]
    gamma = params["ln_f.gamma"]
    if cfg.rms_norm:
        scale = np.sqrt((stream * stream).mean() + cfg.eps)
    else:
        scale = np.sqrt(stream.var() + cfg.eps)
    through = gamma * column / scale      # what one unit of each stream dimension adds
    names = [name for name, _ in parts]
    values = [float(vector @ through) for _, vector in parts]
    if not cfg.rms_norm:
        names.append("ln_f centring (-mean x)")
        values.append(float(-stream.mean() * through.sum()))
    beta = params.get("ln_f.beta")
    if beta is not None:
        names.append("ln_f.beta")
        values.append(float(beta @ column))
    if b_U is not None:
        names.append("head.b_U")
        values.append(float(b_U[token]))
    logit = float(acts["ln_f.out"][b, t] @ column + (0.0 if b_U is None else b_U[token]))
    if cfg.parallel_residual and not cfg.sandwich_norm:
        note = ("parallel blocks: attention and the FFN both add to the stream (neither reads "
                "the other's output), so every term is here")
    capped = None
    if cfg.logit_softcap is not None:   # c tanh(z / c): not linear, so the terms are of z
        capped = float(fwd.acts["logits"][b, t, token])
        note = (note + "; " if note else "") + (
            f"the logit cap {cfg.logit_softcap:g} tanh(z / {cfg.logit_softcap:g}) is not "
            f"linear: the terms add up to z before it ({capped:.6f} after)")
    order = np.argsort(-np.abs(values), kind="stable")
    return Attribution(token, row, position, [names[k] for k in order],
                       np.array(values)[order], logit, capped, note)
