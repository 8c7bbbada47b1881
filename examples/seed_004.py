"""Seed note 004: the 3 x 7 x 7 combined mask, the warm-up schedule, the three cross-entropy
sums it prints, and its positional-encoding loop.

    python examples/seed_004.py
"""

import math

import numpy as np
from notes import agree, differ, heading

from tfmcli.engine import masks, ops
from tfmcli.engine.positional import sinusoidal
from tfmcli.train.optim import warmup_lr

heading("The combined mask of lengths 4, 2, 6 at length 7 (trg_pad_mask & nopeak_mask)")
combined = masks.combined_mask([4, 2, 6], 7, causal=True)                  # (3, 7, 7)
note_rows = {0: 4, 1: 2, 2: 6}                   # each row of the note's printout: min(q + 1, len)
note = np.array([[[k < min(q + 1, n) for k in range(7)] for q in range(7)]
                 for n in note_rows.values()])
agree("shape", combined.shape, (3, 7, 7), atol=0, digits=0)
for b in range(3):
    agree(f"row {b} (length {note_rows[b]}): visible keys per query", combined[b].sum(-1),
          note[b].sum(-1), atol=0, digits=0)
print("  (tfm mask --len 7 --lengths 4,2,6 --json prints the whole 3 x 7 x 7 array)")

heading("The warm-up schedule: lr = d_model^-0.5 min(step^-0.5, step warmup^-1.5)")
lrs = [warmup_lr(step, 512, 200) for step in range(1, 1001)]
peak = int(np.argmax(lrs)) + 1
agree("the peak step, d_model = 512, warmup = 200", peak, 200, atol=0, digits=0)
agree("the peak lr = (512 * 200)^-0.5", max(lrs), 1 / math.sqrt(512 * 200), atol=1e-18,
      theirs="formula")
print("  lr at steps 1, 100, 200, 400, 1000: "
      + ", ".join(f"{warmup_lr(s, 512, 200):.3e}" for s in (1, 100, 200, 400, 1000)))
print("  (Adam with these constants, each term of its update for a few weights, step by step: "
      "tfm adam --warmup 200)")

heading("Cross-entropy with reduction='sum' (3.2: the three sums the note prints)")
logits = np.array([[0.1, 0.3, 7.3], [33, 5, 1], [4, 10, 0.1]])[None]       # (1, 3, 3)
for targets, printed, what in (([2, 0, 1], 0.0042, "correct"), ([0, 2, 2], 49.1042, "incorrect"),
                               ([2, 0, 2], 9.9042, "half correct")):
    loss, _, _ = ops.cross_entropy_forward(logits, np.array([targets]), np.ones((1, 3), bool))
    agree(f"{what}, targets {targets} (mean x 3)", 3 * loss, printed, atol=5e-5, digits=4)

heading("The positional-encoding loop (2.3.1)")
d, pos = 512, 1
note_pe = np.zeros(d)
for i in range(0, d, 2):                       # the note's loop, as printed
    note_pe[i] = np.sin(pos / (10000 ** ((2 * i) / d)))
    note_pe[i + 1] = np.cos(pos / (10000 ** ((2 * (i + 1)) / d)))
pe = sinusoidal(2, d)[pos]
differ("PE[1, 2:4] (the second pair) for d_model = 512", pe[2:4], note_pe[2:4],
       "the loop already steps i by 2 (i = 0, 2, 4, ...) and then writes 2 * i in the "
       "exponent, so pair k gets frequency 1/10000^(4k/d) instead of 1/10000^(2k/d): they fall "
       "twice as fast, down to 1e-8 instead of 1e-4, and the last half of the columns barely "
       "change over any sequence. The cosine also gets 2 * (i + 1), not its pair's exponent. "
       "The PyTorch class of 2.3.2 is right:")
agree("2.3.2's exp(-2i log(10000) / d) at PE[1, 2:4]", pe[2:4],
      [math.sin(math.exp(-2 * math.log(10000) / d)), math.cos(math.exp(-2 * math.log(10000) / d))],
      atol=1e-15, theirs="2.3.2")

heading("Its LayerNorm class (4.4)")
x = np.random.default_rng(0).random((2, 8))
ours, _ = ops.layer_norm_forward(x, np.ones(8), 0.5 * np.ones(8), 1e-6)
note_ln = (x - x.mean(-1, keepdims=True)) / (x.std(-1, ddof=1, keepdims=True) + 1e-6 + 0.5)
differ("LN(x)[0, :3] with bias (beta) 0.5", ours[0, :3], note_ln[0, :3],
       "its forward divides by (std + eps) + bias: the bias lands in the denominator instead of "
       "being added after, and torch's std is the unbiased one (n - 1). With bias 0 at "
       "initialisation the printout (mean 0, var 1) cannot show it.")
