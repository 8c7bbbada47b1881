"""Seed note 000: layer norm and a 2-head attention from default_rng(1000), and the softmax
underflow the note warns about, with tfm's ops beside the numbers the note printed.

    python examples/seed_000.py
"""

import math

import numpy as np
from notes import agree, differ, heading

from tfmcli.engine import ops

# default_rng(1000) in the note's order: X (4, 6), gamma1, beta1, then W_k1, W_q1, W_v1,
# W_k2, W_q2, W_v2 (6, 3) each.
rng = np.random.default_rng(1000)
X = rng.random((4, 6))
gamma1, beta1 = rng.random(6), rng.random(6)
W = {name: rng.random((6, 3)) for name in ("k1", "q1", "v1", "k2", "q2", "v2")}

heading("Layer norm of X (In [6]-[9])")
agree("mu", X.mean(-1), [0.41986877, 0.58406098, 0.49220182, 0.63773979])
agree("std", X.std(-1), [0.16222732, 0.24536075, 0.29169464, 0.27570681])
ln, _ = ops.layer_norm_forward(X, gamma1, beta1, eps=1e-18)
agree("LN(X) row 0", ln[0], [0.14740956, 0.6732444, 0.93201697, -0.28017197, 0.6919807,
                             -0.67674215])
ln_eps, _ = ops.layer_norm_forward(X, gamma1, beta1, eps=1e-5)
note_eps = gamma1 * (X - X.mean(-1, keepdims=True)) / (X.std(-1, keepdims=True) + 1e-5) + beta1
differ("LN(X)[0, 4] with eps = 1e-5", ln_eps[0, 4], note_eps[0, 4],
       "the note divides by std + eps; layer norm (and PyTorch) divides by sqrt(var + eps). "
       "With the note's eps = 1e-9 the two agree to 1e-8 (above), with 1e-5 they do not.")

heading("Head 1 (In [12]-[45]; the note projects X itself, not LN(X))")
K1, Q1, V1 = X @ W["k1"], X @ W["q1"], X @ W["v1"]
agree("K1 row 0", K1[0], [1.2527992, 1.32075642, 0.93814284])
agree("Q1 row 0", Q1[0], [1.32297136, 0.92811187, 0.93688803])
everywhere = np.ones((4, 4), dtype=bool)
context1, scores1, cache1 = ops.attention_forward(Q1, K1, V1, everywhere, 1 / math.sqrt(3))
agree("scores1 row 0 (Q K^T / sqrt 3)", scores1[0], [2.17208522, 3.521272, 2.77544456, 3.23341389])
agree("attn1 row 0 (softmax, row max)", cache1.pattern[0],
      [0.1044632, 0.40263147, 0.19098488, 0.30192045])
agree("output1 row 0", context1[0], [2.14579748, 2.05334122, 1.59889611])

heading("Head 2 and the two heads concatenated")
K2, Q2, V2 = X @ W["k2"], X @ W["q2"], X @ W["v2"]
context2, _, cache2 = ops.attention_forward(Q2, K2, V2, everywhere, 1 / math.sqrt(3))
agree("attn2 row 0", cache2.pattern[0], [0.13172653, 0.27212327, 0.18301422, 0.41313598])
agree("output2 row 0", context2[0], [1.61703732, 1.08593014, 1.76418502])
q, k, v = (ops.split_heads((X @ np.concatenate([W[a + "1"], W[a + "2"]], 1))[None], 2)
           for a in "qkv")
both, _, _ = ops.attention_forward(q, k, v, everywhere, 1 / math.sqrt(3))
agree("tfm's (1, 2, 4, 3) heads, merged, row 0", ops.merge_heads(both)[0, 0],
      np.concatenate([context1[0], context2[0]]))

heading("Softmax: why each row subtracts its own max (In [42])")
x = np.array([1.0, 2.0, 3.0])
global_max = np.exp(x - 1000)          # the max of another row of the same matrix
agree("e^(x - 1000) for x = [1, 2, 3], the note's warning", global_max, [0.0, 0.0, 0.0], atol=0)
row_max, _ = ops.softmax_forward(x)
print(f"      0/0 would follow; tfm's softmax subtracts the row's own max: "
      f"{np.array2string(row_max, precision=6)}")
