"""Seed note 002: the illustrated self-attention example with integer matrices (softmax and
outputs, unscaled as the note's code does it, and scaled as its formula says), temperature,
and the positional-encoding matrix.

    python examples/seed_002.py
"""

import math

import numpy as np
from notes import agree, differ, heading

from tfmcli.engine import ops
from tfmcli.engine.positional import sinusoidal
from tfmcli.explain.steps import ILLUSTRATED

X, W_Q, W_K, W_V = (ILLUSTRATED[k] for k in ("X", "W_Q", "W_K", "W_V"))
Q, K, V = X @ W_Q, X @ W_K, X @ W_V
everywhere = np.ones((3, 3), dtype=bool)

heading("Queries, keys, values and scores (integers: exact)")
agree("Q", Q, [[1, 0, 2], [2, 2, 2], [2, 1, 3]], atol=0, digits=0)
agree("K", K, [[0, 1, 1], [4, 4, 0], [2, 3, 1]], atol=0, digits=0)
agree("V", V, [[1, 2, 3], [2, 8, 0], [2, 6, 3]], atol=0, digits=0)
agree("Q K^T", Q @ K.T, [[2, 4, 4], [4, 16, 12], [4, 12, 10]], atol=0, digits=0)

heading("softmax(Q K^T) @ V as the note's code computes it: no 1/sqrt(d_k)")
context, _, cache = ops.attention_forward(Q, K, V, everywhere, scale=1.0)
agree("softmax row 1 (printed to 5 digits)", cache.pattern[1], [6.0337e-06, 9.8201e-01, 1.7986e-02],
      atol=1e-4 * 0.99, digits=6)
agree("outputs", context, [[1.9366, 6.6831, 1.5951], [2.0000, 7.9640, 0.0540],
                           [1.9997, 7.7599, 0.3584]], atol=5e-5, digits=4)
differ("the illustration's rounded softmax, row 0", cache.pattern[0], [0.0, 0.5, 0.5],
       "the picture's 'approximate' table is not a rounding of the computed one: 0.0634 "
       "rounds to 0.1, not 0.0, so its outputs [2.0, 7.0, 1.5] are not these either.", digits=4)
scaled_context, _, scaled = ops.attention_forward(Q, K, V, everywhere, 1 / math.sqrt(3))
differ("with the scale the formula asks for, softmax row 0", scaled.pattern[0], cache.pattern[0],
       "the note's formula divides Q K^T by sqrt(d_k) = sqrt(3) but its code does not; tfm "
       "prints both (tfm attn --example illustrated). Scaled, row 0 is e^(2,4,4)/sqrt(3) over "
       "its sum.", digits=4)

heading("Temperature: softmax(z / T) on row 1's scores (4, 16, 12)")
z = np.array([4.0, 16.0, 12.0])
for T in (0.5, 1.0, 2.0, 10.0):
    p, _ = ops.softmax_forward(z / T)
    print(f"  T = {T:<4g} [" + " ".join(f"{v:.4f}" for v in p) + "]"
          f"   largest {p.max():.4f}")
print("  lower T: sharper, towards argmax; higher T: flatter, towards uniform, as the note says")

heading("Positional encoding: p_t = [sin(w_k t), cos(w_k t), ...], w_k = 1/10000^(2k/d)")
pe = sinusoidal(4, 4)
agree(
    "PE[1] for d = 4 (k = 0, 1)",
    pe[1],
    [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)],
    atol=1e-15,
    theirs="formula",
)
one_based = [math.sin(0.01), math.cos(0.01), math.sin(1e-4), math.cos(1e-4)]
differ("the same row with k counted from 1, as the note's vector writes w_1 .. w_(d/2)",
       pe[1], one_based,
       "the formula (i = 2k, w_k = 1/10000^(2k/d)) starts at k = 0, frequency 1; the vector "
       "beneath it starts at w_1 = 1/10000^(2/d). Counted from 1, the fastest pair is lost.")
