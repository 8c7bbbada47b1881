"""One feed-forward sublayer at one position, number by number, forward and backward (``tfm ffn``).

``FFN(x) = act(x W_1 + b_1) W_2 + b_2``, or with SwiGLU ``(silu(x W_gate + b_gate) * (x W_1 +
b_1)) W_2 + b_2`` (GeGLU: gelu for silu). Seed 003 derived its backward by hand and took the
ReLU's derivative from the wrong array (the attention's K, not the FFN's own pre-activation)
and applied it before the product with ``W_2^T`` instead of after; this recomputes every
intermediate of one row from the model's own input to that FFN, so that each number a learner
derives can be checked. The activation and its slope are written out here, not taken from
``ops``; the results are checked against the model's own activations, the backward pass's
gradients and central differences.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tfmcli.check.gradcheck import batched_central_differences
from tfmcli.engine import ops
from tfmcli.engine.config import Config
from tfmcli.engine.model import Forward, check_within

GELU_C = math.sqrt(2.0 / math.pi)
GATE_UNITS = {
    "swiglu": "silu",
    "geglu": "gelu",
    "geglu_erf": "gelu_erf",
}  # what turns a gated FFN's gate into weights


def input_name(cfg: Config, block: int) -> str:
    """The activation the FFN of ``block`` reads: LN2's output in Pre-LN, LN1's in Post-LN
    and in a parallel block with one norm."""
    ln = "ln2" if cfg.norm == "pre" and not cfg.shared_norm else "ln1"
    return f"blocks.{block}.{ln}.out"


def activation(pre: np.ndarray, name: str) -> np.ndarray:
    """relu: max(pre, 0); gelu (tanh form): 0.5 pre (1 + tanh(sqrt(2/pi) (pre + 0.044715 pre^3)));
    silu (SwiGLU's gate): pre sigmoid(pre) = pre / (1 + exp(-pre)); gelu_erf: pre Phi(pre),
    Phi(pre) = 0.5 (1 + erf(pre / sqrt 2)), by ``math.erf`` here."""
    if name == "relu":
        return np.maximum(pre, 0.0)
    if name == "silu":
        return pre * ops.sigmoid(pre)
    if name == "gelu_erf":
        return pre * _normal_cdf(pre)
    return 0.5 * pre * (1.0 + np.tanh(GELU_C * (pre + 0.044715 * pre ** 3)))


def slope(pre: np.ndarray, name: str) -> np.ndarray:
    """d act / d pre. relu: 1 where pre > 0, else 0 (0 at exactly 0, as PyTorch takes it);
    gelu: 0.5 (1 + t) + 0.5 pre (1 - t^2) sqrt(2/pi) (1 + 3 x 0.044715 pre^2), t the tanh;
    silu: s (1 + pre (1 - s)), s = sigmoid(pre); gelu_erf: Phi(pre) + pre phi(pre), phi the
    normal density exp(-pre^2 / 2) / sqrt(2 pi)."""
    if name == "relu":
        return (pre > 0).astype(np.float64)
    if name == "silu":
        s = ops.sigmoid(pre)
        return s * (1.0 + pre * (1.0 - s))
    if name == "gelu_erf":
        return _normal_cdf(pre) + pre * np.exp(-pre ** 2 / 2) / math.sqrt(2 * math.pi)
    t = np.tanh(GELU_C * (pre + 0.044715 * pre ** 3))
    return 0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * pre ** 2)


def _normal_cdf(pre: np.ndarray) -> np.ndarray:
    """Phi(pre) = 0.5 (1 + erf(pre / sqrt 2)), entry by entry with ``math.erf``."""
    return np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in pre.reshape(-1)],
                    dtype=np.float64).reshape(pre.shape)


class FFNExplained(NamedTuple):
    """With SwiGLU, ``gate`` and ``dgate`` are set, ``hidden`` is silu(gate) * pre, ``slope``
    silu'(gate), ``dpre`` dhidden * silu(gate), and ``dx`` takes dgate W_gate^T as well. GeGLU
    the same with gelu for silu. ``gate_act`` is silu(gate) or gelu(gate); ``silu_gate`` is
    SwiGLU's alone."""
    x: np.ndarray          # (d,) the input row
    pre: np.ndarray        # (d_ff,) x W_1 + b_1
    hidden: np.ndarray     # (d_ff,) act(pre)
    out: np.ndarray        # (d,) hidden W_2 + b_2
    dout: np.ndarray       # (d,) d loss / d out, from the backward pass
    dhidden: np.ndarray    # (d_ff,) dout W_2^T
    slope: np.ndarray      # (d_ff,) act'(pre)
    dpre: np.ndarray       # (d_ff,) dhidden * slope
    dx: np.ndarray         # (d,) dpre W_1^T
    numeric_slope: np.ndarray  # central differences of act at pre (silu or gelu at gate)
    numeric_dx: np.ndarray     # central differences of sum(dout * FFN(x)) in x
    gate: np.ndarray | None = None       # (d_ff,) x W_gate + b_gate (a gated FFN)
    silu_gate: np.ndarray | None = None  # (d_ff,) silu(gate), each unit's weight (SwiGLU)
    dgate: np.ndarray | None = None      # (d_ff,) dhidden * pre * silu'(gate) (or gelu')
    gate_act: np.ndarray | None = None   # (d_ff,) silu(gate) or gelu(gate) (a gated FFN)


def explain(params: dict, fwd: Forward, dout_all: np.ndarray, cfg: Config, block: int, row: int,
            t: int, step: float = 1e-6) -> FFNExplained:
    """The FFN of ``block`` at batch row ``row``, position ``t``, in float64; ``dout_all`` is
    the gradient of the loss with respect to its output (``grads.acts['blocks.i.ffn.out']``).
    A block, row or position the run does not have is a ``ValueError``."""
    B, T = fwd.inputs.tokens.shape
    check_within("explain", block=(block, cfg.layers), row=(row, B), position=(t, T))
    p = f"blocks.{block}.ffn."
    def weight(name):   # in float64; a bias the model does not have (Config.bias) adds 0
        return params[p + name].astype(np.float64) if p + name in params else 0.0

    W_1, b_1, W_2, b_2 = (weight(name) for name in ("W_1", "b_1", "W_2", "b_2"))
    x = fwd.acts[input_name(cfg, block)][row, t].astype(np.float64)
    dout = dout_all[row, t].astype(np.float64)
    gated = cfg.gated
    if gated:
        W_gate, b_gate = weight("W_gate"), weight("b_gate")

    pre, dhidden = x @ W_1 + b_1, dout @ W_2.T
    gate = x @ W_gate + b_gate if gated else None

    def contracted_moved(js, steps):
        """sum(dout * FFN(x)) at x + steps[i] e_js[i], whose gradient in x is dx: moving x's
        entry j by s moves pre = x W_1 + b_1 by s W_1[j] (and the gate by s W_gate[j])."""
        pres = pre + steps[:, None] * W_1[js]
        if gated:   # silu(x W_gate + b_gate) * (x W_1 + b_1), or gelu's
            gates = gate + steps[:, None] * W_gate[js]
            hidden = activation(gates, GATE_UNITS[cfg.activation]) * pres
        else:   # act(x W_1 + b_1)
            hidden = activation(pres, cfg.activation)
        return (hidden @ W_2 + b_2) @ dout

    gate_act = dgate = None
    if gated:   # the product rule: each factor's gradient holds the other
        name = GATE_UNITS[cfg.activation]
        gate_act, s = activation(gate, name), slope(gate, name)
        hidden = gate_act * pre
        dpre, dgate = dhidden * gate_act, dhidden * pre * s
        dx = dpre @ W_1.T + dgate @ W_gate.T
    else:
        name = cfg.activation
        hidden, s = activation(pre, name), slope(pre, name)
        dpre = dhidden * s
        dx = dpre @ W_1.T
    at = gate if gated else pre   # where the slope is taken
    h = step * np.maximum(1.0, np.abs(at))
    numeric_slope = (activation(at + h, name) - activation(at - h, name)) / (2 * h)
    numeric_dx = batched_central_differences(contracted_moved, x, step)
    return FFNExplained(x, pre, hidden, hidden @ W_2 + b_2, dout, dhidden, s, dpre, dx,
                        numeric_slope, numeric_dx, gate,
                        gate_act if cfg.activation == "swiglu" else None, dgate, gate_act)
