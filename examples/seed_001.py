"""Seed note 001: the LM head's gradients dZ = (P - Y) / N, dW, db, dh, from the note's set-up
(default_rng(1000), B = 2, T = 4, d_model = 6, V = 20), checked three ways: against the note's
formulas written out, against tfm's ops, and against central differences.

    python examples/seed_001.py
"""

import numpy as np
from notes import agree, differ, heading

from tfmcli.engine import ops

B, T, d_model, V = 2, 4, 6, 20
rng = np.random.default_rng(1000)
X = rng.random((T, d_model))

heading("The draws (In [4] and the gamma/beta cell)")
agree("X row 0", X[0], [0.52138574, 0.60384185, 0.4709418, 0.20324794, 0.52875903, 0.19103628])
gamma, beta = rng.random(d_model), rng.random(d_model)
note_gamma = [0.23502814, 0.65818858, 0.51673102, 0.82385723, 0.18965801, 0.98047955]
differ("gamma, drawn right after X", gamma, note_gamma,
       "the note's gamma does not follow from its own draw order: after X, default_rng(1000) "
       "gives gamma = [0.0175 ...] (seed 000 prints the same). The note's numbers are the "
       "seventh draw of six after X: its cell (In [None]) was run four times before printing.")
for _ in range(4):
    rng.random(d_model)
again = rng.random(d_model)
agree("the seventh draw of six after X", again, note_gamma)
agree("X * gamma + beta row 0 with the note's gamma and beta",
      X[0] * again + rng.random(d_model),
      [0.51538536, 0.85089509, 0.51763486, 0.49021379, 0.72770043, 0.61867241])

heading("The LM head: Z = h W + b, P = softmax(Z), loss = mean cross-entropy over N tokens")
h = rng.normal(size=(B, T, d_model))                           # the stack's output, LN applied
W, b = rng.normal(size=(d_model, V)), rng.normal(size=V)
targets = rng.integers(0, V, size=(B, T))
valid = np.array([[True] * 4, [True, True, True, False]])     # a padded token: N = 7
Z, cache = ops.linear_forward(h, W, b)
loss, P, ce = ops.cross_entropy_forward(Z, targets, valid)
N = int(valid.sum())
Y = np.eye(V)[targets]
dZ_note = (P - Y) / N * valid[..., None]                       # the note's dZ = (P - Y) / N
dZ = ops.cross_entropy_backward(ce)
agree(
    "dZ = (P - Y) / N at [0, 0, :4]", dZ[0, 0, :4], dZ_note[0, 0, :4], atol=1e-15, theirs="formula"
)
agree("dZ is 0 at the padded token", np.abs(dZ[1, 3]).max(), 0.0, atol=0, theirs="formula")
dh, dW, db = ops.linear_backward(dZ, cache)
agree("dW = sum_(b,t) h_bt^T dZ_bt, row 0", dW[0, :4],
      np.einsum("btd,btv->dv", h, dZ_note)[0, :4], atol=1e-15, theirs="formula")
agree("db = sum_(b,t) dZ_bt", db[:4], dZ_note.sum((0, 1))[:4], atol=1e-15, theirs="formula")
agree("dh_bt = dZ_bt W^T at [0, 0]", dh[0, 0], dZ_note[0, 0] @ W.T, atol=1e-15, theirs="formula")

heading("Central differences of the loss (h = 1e-6)")
step = 1e-6
for name, array, grad, index in (("W[2, 5]", W, dW, (2, 5)), ("b[7]", b, db, (7,)),
                                 ("h[0, 1, 3]", h, dh, (0, 1, 3))):
    original = array[index]
    array[index] = original + step
    plus = ops.cross_entropy_forward(ops.linear_forward(h, W, b)[0], targets, valid)[0]
    array[index] = original - step
    minus = ops.cross_entropy_forward(ops.linear_forward(h, W, b)[0], targets, valid)[0]
    array[index] = original
    agree(f"d loss / d {name}: analytic vs numeric", grad[index], (plus - minus) / (2 * step),
          atol=1e-9, theirs="numeric")
print("  (`tfm loss -t t` lays out one position of a model's run the same way: the logits, p,\n"
      "   -log p[target], p - y, dZ = (p - y) / N and dh = dZ W^T, each against the backward\n"
      "   pass and dh against central differences.)")
