"""Seed note 003: its block from default_rng(4000) (B = 2, T = 4, d_model = 6, H = 2), forward,
then the full backward with the note's own dout, and each derivation mistake with the number
it gives beside the right one.

The note's block: g = X + MHA(X) (no projection W_O, no biases, causal), out = FFN(LN(g)) + g
with FFN(x) = relu(x W_expand + b_expand) W_shrink + b_shrink.

    python examples/seed_003.py
"""

import math

import numpy as np
from notes import agree, differ, heading

from tfmcli.engine import ops
from tfmcli.engine.masks import causal_mask

rng = np.random.default_rng(4000)
X = rng.random((2, 4, 6))
P = {name: rng.random((6, 6)) for name in ("Wk", "Wq", "Wv")}
P["W_expand"], P["b_expand"] = rng.random((6, 24)), rng.random(24)
P["gamma"], P["beta"] = rng.random(6), rng.random(6)
P["W_shrink"], P["b_shrink"] = rng.random((24, 6)), rng.random(6)
DOUT = np.zeros((2, 4, 6))   # the note's dout (In [8]): rows past each sequence's end are 0
DOUT[0, :3] = [[0.07788198, -0.00560083, -0.44371856, 0.38684485, 0.1261935, -0.13216348],
               [0.16143276, 0.03677408, 0.24246872, -0.01143926, -0.14273741, -0.05650211],
               [-0.07538471, 0.03161602, -0.11086203, -0.07365076, 0.12672887, 0.08785918]]
DOUT[1, :2] = [[0.16217772, 0.03159888, 0.2467916, -0.02172796, -0.1281925, -0.02960269],
               [-0.14111161, 0.07411266, -0.21028277, -0.12922675, 0.26637395, 0.19252851]]


def forward(X, P):
    """The note's block with tfm's ops; returns out and every cache the backward needs."""
    q, k, v = (ops.split_heads(X @ P[w], 2) for w in ("Wq", "Wk", "Wv"))      # (2, 2, 4, 3)
    context, _, c_attn = ops.attention_forward(q, k, v, causal_mask(4), 1 / math.sqrt(3))
    g = X + ops.merge_heads(context)                                           # X_FFN
    ghat, c_ln = ops.layer_norm_forward(g, P["gamma"], P["beta"], 1e-5)        # X_FFN_N
    pre, c_expand = ops.linear_forward(ghat, P["W_expand"], P["b_expand"])     # (2, 4, 24)
    hidden, c_relu = ops.relu_forward(pre)
    y, c_shrink = ops.linear_forward(hidden, P["W_shrink"], P["b_shrink"])     # X_shrink
    return y + g, dict(attn=c_attn, ln=c_ln, expand=c_expand, relu=c_relu, shrink=c_shrink,
                       g=g, ghat=ghat, pre=pre, k=X @ P["Wk"])


def backward(dout, X, P, c):
    """The right backward: every gradient of sum(out * dout)."""
    grads = {}
    dhidden, grads["W_shrink"], grads["b_shrink"] = ops.linear_backward(dout, c["shrink"])
    dpre = ops.relu_backward(dhidden, c["relu"])              # the mask of the pre-activation
    dghat, grads["W_expand"], grads["b_expand"] = ops.linear_backward(dpre, c["expand"])
    dg_ln, grads["gamma"], grads["beta"] = ops.layer_norm_backward(dghat, c["ln"])
    dg = dout + dg_ln                                         # out = FFN(LN(g)) + g
    dq, dk, dv, _, _ = ops.attention_backward(ops.split_heads(dg, 2), c["attn"])
    dX = dg
    for name, dh in (("Wq", dq), ("Wk", dk), ("Wv", dv)):
        dh = ops.merge_heads(dh)
        grads[name] = X.reshape(-1, 6).T @ dh.reshape(-1, 6)
        dX = dX + dh @ P[name].T
    return grads, dX, dict(dpre=dpre, dghat=dghat, dg_ln=dg_ln, dg=dg, dv=dv)


out, c = forward(X, P)
heading("Forward (In [11]-[33])")
agree("X[0, 0]", X[0, 0], [0.45461138, 0.9079045, 0.22341803, 0.75301023, 0.21061655, 0.28646412])
agree("K = X Wk, [0, 0]", c["k"][0, 0], [1.69827184, 0.48160908, 1.48858585, 1.38148467,
                                          1.43737408, 1.74600031])
agree("causal attention, batch 0, head 0, query 3", c["attn"].pattern[0, 0, 3],
      [0.09426586, 0.09705267, 0.03723875, 0.77144272])
agree("X_FFN = X + attention, [0, 0]", c["g"][0, 0],
      [1.50541969, 2.18379059, 1.45341472, 2.02077238, 1.76099727, 1.26516251])
agree("X_FFN_N = LN(X_FFN), [0, 0]", c["ghat"][0, 0],
      [0.08728607, 1.49611494, 0.43019102, 1.02796724, 1.16567207, -0.44679896])
agree("out = FFN(LN(g)) + g, [0, 0]", out[0, 0],
      [29.26176872, 31.54301875, 34.95023724, 34.57109221, 34.93276806, 37.74355132], atol=2e-8)
print("  (the note's FFN formula wraps the whole FFN in one more max(0, .); its code does "
      "not, and\n   neither does tfm: FFN(x) = max(0, x W1 + b1) W2 + b2, as in the paper)")

grads, dX, d = backward(DOUT, X, P, c)
heading("Backward with the note's dout")
agree("db_shrink = sum of dout (In [39])", grads["b_shrink"],
      [0.18499614, 0.16850081, -0.27560304, 0.15080012, 0.24836641, 0.06211941])

note_dpre = (DOUT * (c["k"] > 0)) @ P["W_shrink"].T          # In [49]: the mask from K
agree("the note's db_expand reproduced, as printed", note_dpre.sum((0, 1))[:4],
      [0.52807845, 0.02083732, 0.29501652, 0.11307535])
differ("db_expand[9]: the ReLU's mask (In [49])", grads["b_expand"][9:10],
       note_dpre.sum((0, 1))[9:10],
       "the note masks with K > 0 (the attention keys, all positive here: no mask at all) and "
       "before the product; the ReLU's derivative is P > 0 of its own input P = x W_expand + "
       "b_expand, applied after: (dout W_shrink^T) * (P > 0). P is negative only at [1, 1, 9], "
       "so the entries the note printed ([:4], above) agree and db_expand[9] does not.")

note_dghat = note_dpre @ P["W_expand"].T
ghat, dghat = c["ghat"], note_dghat                     # the note's own upstream gradient
sigma = ghat.std(-1, keepdims=True)                     # In [63]: the output's std
note_dg = (1 / (6 * (sigma ** 2 + 1e-5))) * (6 * dghat - dghat.sum(-1, keepdims=True)
                                             - ghat * dghat.sum(-1, keepdims=True))
right_dg, _, _ = ops.layer_norm_backward(dghat, c["ln"])
differ("dg[0, 1, :3], layer norm's backward on the note's own dghat (In [60]-[64])",
       right_dg[0, 1, :3], note_dg[0, 1, :3],
       "three slips: sigma is the std of LN's output (1 by construction) not of its input; "
       "the factor is 1 / (d sqrt(var + eps)), not 1 / (d (sigma^2 + eps)); and the last sum "
       "must be sum(dghat * ghat), not sum(dghat). tfm's dg agrees with central differences "
       "(below); the note's is off by up to 7.")
agree(
    "the note's dg reproduced, as printed",
    note_dg[0, 1, :3],
    [-4.18273278, -1.40989492, -7.14950445],
)

step = 1e-6
numeric = np.zeros(3)
for j in range(3):
    g = c["g"].copy()
    g[0, 1, j] += step
    plus = (ops.layer_norm_forward(g, P["gamma"], P["beta"], 1e-5)[0] * dghat).sum()
    g[0, 1, j] -= 2 * step
    minus = (ops.layer_norm_forward(g, P["gamma"], P["beta"], 1e-5)[0] * dghat).sum()
    numeric[j] = (plus - minus) / (2 * step)
agree("tfm's dg[0, 1, :3] against central differences", right_dg[0, 1, :3], numeric, atol=1e-8,
      theirs="numeric")

differ("dFFN_input = dout + dg, [0, 0, :3] (In [67])", d["dg"][0, 0, :3],
       [0.70985293, 0.35460159, -0.11310386],
       "the residual sum is right; the dg in it carries both mistakes above (and the right dg "
       "also starts from the right dghat).")
differ("dV, batch 0, head 0, key 0 (In [83])", d["dv"][0, 0, 0],
       [-1.15353813, -0.27324737, -3.7017808],
       "dV = softmax^T @ dContext is the right formula; its input dContext inherits the "
       "mistakes.")
differ("dW_V row 0, first five (In [96])", grads["Wv"][0, :5],
       [-2.67500296, -2.06836852, -6.84482651, 1.07228382, -7.95097007],
       "likewise: right formula, wrong upstream gradient.")
print("  (the note stops at dV and dW_V. The rest of attention's backward, through the softmax "
      "to dQ and dK, is in `tfm attn --backward`, and one query's row of it number by number "
      "in `tfm attn --query t --backward`; the residual sums it splits out (In [67]), with "
      "every path into them, in `tfm block --position t`.)")

heading("The full right backward, every parameter, against central differences of sum(out * dout)")
for name in ("Wq", "Wk", "Wv", "W_expand", "b_expand", "gamma", "beta", "W_shrink", "b_shrink"):
    flat, analytic = P[name].reshape(-1), grads[name].reshape(-1)
    i = int(np.argmax(np.abs(analytic)))
    original = flat[i]
    flat[i] = original + step
    plus = (forward(X, P)[0] * DOUT).sum()
    flat[i] = original - step
    minus = (forward(X, P)[0] * DOUT).sum()
    flat[i] = original
    agree(f"d/d {name} at its largest entry", analytic[i], (plus - minus) / (2 * step),
          atol=1e-6 * max(1.0, abs(analytic[i])), theirs="numeric")
