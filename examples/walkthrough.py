"""A notebook-style walk through tfm's Python API: run it, or paste it cell by cell.

    python examples/walkthrough.py

Each cell prints something a hand derivation can be checked against.
"""

import numpy as np

import tfmcli
from tfmcli.engine import ops
from tfmcli.engine.sizes import flops, memory_estimate, param_count

# %% 1. A run: config, parameters, inputs, forward, backward
cfg = tfmcli.Config(seed=1000)                      # B=2 T=4 d=6 H=2 V=8 L=1, Pre-LN, causal
params = tfmcli.init_params(cfg)
inputs = tfmcli.make_inputs(cfg)
fwd = tfmcli.forward(params, inputs, cfg)
grads = tfmcli.backward(params, fwd, cfg)
print(f"loss = {fwd.loss:.6f} over {int(inputs.lengths.sum())} positions")
print("tokens  ", inputs.tokens.tolist())
print("targets ", inputs.targets.tolist(), "(the next token)")

# %% 2. Every activation has a name, in forward order
for name, value in fwd.acts.items():
    print(f"{name:24s} {str(value.shape):14s}")

# %% 3. dlogits is (P - Y) / N on the positions counted in the loss (seed 001)
P = fwd.acts["probs"]
Y = np.eye(cfg.vocab)[inputs.targets]
N = int(inputs.lengths.sum())
assert np.allclose(grads.acts["logits"], (P - Y) / N)
print("dlogits[0, 0] =", np.round(grads.acts["logits"][0, 0], 4))

# %% 4. A hidden key has score -inf, probability 0 and gradient 0
scores = fwd.acts["blocks.0.attn.scores"][0, 0]
print("scores of head 0, row 0:\n", np.round(scores, 3))
print("its gradient:\n", np.round(grads.acts["blocks.0.attn.scores"][0, 0], 4))

# %% 5. The layer-norm backward, checked by central differences on one entry
x = np.random.default_rng(0).normal(size=(3, 6))
gamma, beta, dout = np.ones(6), np.zeros(6), np.random.default_rng(1).normal(size=(3, 6))
out, cache = ops.layer_norm_forward(x, gamma, beta, 1e-5)
dx, dgamma, dbeta = ops.layer_norm_backward(dout, cache)
h = 1e-5
plus, minus = x.copy(), x.copy()
plus[1, 2] += h
minus[1, 2] -= h
fake_loss = lambda x_: (ops.layer_norm_forward(x_, gamma, beta, 1e-5)[0] * dout).sum()  # noqa: E731
numeric = (fake_loss(plus) - fake_loss(minus)) / (2 * h)
print(f"dx[1, 2] analytic {dx[1, 2]:+.8f}  numeric {numeric:+.8f}")

# %% 6. The whole model, every parameter: central differences
report = tfmcli.gradcheck(params, inputs, cfg)
print(f"gradcheck passed={report.passed}, worst {report.worst.name} {report.worst.rel_err:.1e}")

# %% 7. Sizes without allocating: a GPT-2-small-shaped block
big = tfmcli.Config(batch=1, seq_len=1024, d_model=768, heads=12, vocab=50257)
forward_flops, backward_flops = flops(big)
print(f"{param_count(big):,} parameters, {forward_flops / 1e9:.1f} GFLOP forward, "
      f"{memory_estimate(big)['total'] / 2**30:.2f} GiB peak forward + backward")

# %% 8. One position by hand, every intermediate: tfm embed, ln, ffn, block, loss, attn --query
embed = tfmcli.explain.embedding.explain(params, fwd, grads, cfg, 0, 2)
block = tfmcli.explain.block.explain(params, fwd, grads, cfg, 0, 0, 2)
ln = tfmcli.explain.layernorm.explain(
    params, fwd, grads.acts["blocks.0.ln1.out"], cfg, "blocks.0.ln1", 0, 2
)
ffn = tfmcli.explain.feedforward.explain(params, fwd, grads.acts["blocks.0.ffn.out"], cfg, 0, 0, 2)
head = tfmcli.explain.loss.explain(params, fwd, cfg, 0, 2)
query = tfmcli.explain.steps.explain_query_backward(
    fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 0, 0, 2
)
for name, analytic, numeric in (("embed dW_E", embed.dw_e[embed.checked], embed.numeric_dw_e),
                                ("ln1 dx", ln.dx, ln.numeric_dx),
                                ("ffn dx", ffn.dx, ffn.numeric_dx),
                                ("block dx", block.backward[-1].value[block.checked],
                                 block.numeric_dx),
                                ("loss dh", head.dh, head.numeric_dh),
                                ("attn dq", query.dq, query.numeric_dq)):
    print(f"{name:10} against central differences: {np.abs(analytic - numeric).max():.1e}")
print(f"-log p(target) at (0, 2) = {head.term:.6f}, {head.term_share:.6f} of the loss")
