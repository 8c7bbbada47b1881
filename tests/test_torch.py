"""tfm against PyTorch autograd: the same model, written independently in plain torch ops.

The torch model (``tfmcli/check/reference.py``, which ``tfm check --against torch`` runs too) shares
nothing with tfmcli but the parameter dict and the inputs: the
embedding is indexing, the positional encoding is computed in torch, layer norm is
``F.layer_norm``, attention is written out with ``masked_fill(-inf)`` and ``torch.softmax``, the
loss is ``F.cross_entropy`` over the valid positions. Everything runs in float64, so loss,
logits, attention patterns and gradients must agree to rounding (1e-9 relative).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import tfmcli

torch = pytest.importorskip("torch")

from helpers import random_params  # noqa: E402
from tfmcli.check import reference  # noqa: E402  (after the skip: it needs torch to run)
from tfmcli.check.reference import torch_sinusoidal  # noqa: E402

TOL = 1e-9

MASKS = {
    "causal": dict(causal=True, lengths=None),
    "padding": dict(causal=False, lengths=(4, 2)),
    "causal+padding": dict(causal=True, lengths=(3, 1)),
}

CONFIGS = [
    pytest.param(dict(norm=norm, activation=act, layers=layers, **MASKS[mask]),
                 id=f"{norm}-{act}-{mask}-L{layers}")
    for norm, act, mask, layers in itertools.product(
        ("pre", "post"), ("relu", "gelu"), MASKS, (1, 2))
] + [
    pytest.param(dict(pe="none", norm="pre", activation="gelu", layers=2, causal=True,
                      lengths=(3, 4)), id="pe-none"),
    pytest.param(dict(d_ff=10, heads=3, norm="post", activation="relu", layers=2, causal=True,
                      lengths=(4, 2, 5), batch=3, seq_len=5, vocab=11), id="d_ff-10-heads-3"),
]


def torch_run(params, inputs, cfg):
    """(loss, logits, patterns, leaves) from tfmcli.check.reference, the independent torch model."""
    return reference.torch_run(params, inputs, cfg)


def rel(ours, theirs, floor):
    """max |a - t| / max(max |t|, floor, 1e-300)."""
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    size = max(float(np.abs(theirs).max()), floor, 1e-300)
    return float(np.abs(np.asarray(ours) - theirs).max()) / size


@pytest.mark.parametrize("fields", CONFIGS)
def test_matches_torch_autograd(fields):
    cfg = tfmcli.Config(**fields)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    loss, logits, patterns, P = torch_run(params, inputs, cfg)

    largest = max(float(P[name].grad.abs().max()) for name in P)
    floor = 1e-12 * largest
    assert largest > 0.01
    assert abs(fwd.loss - loss.item()) / abs(loss.item()) <= TOL
    assert rel(fwd.acts["logits"], logits, floor) <= TOL
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        assert rel(fwd.acts[p + "attn.pattern"], patterns[p], floor) <= TOL, p

    assert set(grads) == set(P)
    for name, leaf in P.items():
        if name.endswith("attn.b_K"):
            # The exact gradient is 0 (a constant added to a row of scores leaves its softmax
            # alone), so both sides hold pure rounding, ~1e-17: relative agreement of two noises
            # means nothing. Check both are zero to rounding instead.
            assert np.abs(grads[name]).max() <= floor, name
            assert float(leaf.grad.abs().max()) <= floor, name
            continue
        assert rel(grads[name], leaf.grad, floor) <= TOL, name

    # Activation gradients: d loss / d logits, and d loss / d pattern of block 0 (which is
    # non-zero on hidden keys too: it is dcontext @ v^T, before the softmax zeroes it).
    assert rel(grads.acts["logits"], logits.grad, floor) <= TOL
    dpattern = patterns["blocks.0."].grad
    assert rel(grads.acts["blocks.0.attn.pattern"], dpattern, floor) <= TOL
    assert float(dpattern.abs().max()) > 1e-4


def assert_matches_torch(params, inputs, cfg):
    """Loss, logits and every parameter gradient (b_K aside: 0 in exact arithmetic) agree with
    torch to TOL, and each gradient is big enough to say something. Returns tfm's gradients."""
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    loss, logits, patterns, P = torch_run(params, inputs, cfg)
    floor = 1e-12 * max(float(P[name].grad.abs().max()) for name in P)
    assert abs(fwd.loss - loss.item()) / abs(loss.item()) <= TOL
    assert rel(fwd.acts["logits"], logits, floor) <= TOL
    assert set(grads) == set(P)
    for name, leaf in P.items():
        if not name.endswith("attn.b_K"):
            assert rel(grads[name], leaf.grad, floor) <= TOL, name
            assert float(leaf.grad.abs().max()) > 1e-6, name
    return grads


@pytest.mark.parametrize("fields", CONFIGS)
def test_matches_torch_autograd_at_random_parameters(fields):
    """The whole grid again at random O(1) parameters, gammas, betas and biases included: at
    initial weights a gamma is 1 and a bias 0, and a mistake in their terms hides."""
    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    assert_matches_torch(params, tfmcli.make_inputs(cfg), cfg)


@pytest.mark.parametrize("norm, activation", [("pre", "gelu"), ("post", "relu")])
def test_tokens_run_at_random_parameters_matches_torch(norm, activation):
    """Padding, unscored last positions, and every gamma, beta and bias drawn O(1)."""
    cfg = tfmcli.Config(batch=3, seq_len=5, lengths=(5, 2, 4), norm=norm, activation=activation,
                        layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=7)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7], [6, 6, 0, 1]])
    assert_matches_torch(params, inputs, cfg)


GPT2_LIKE = [
    pytest.param(dict(pe="learned", n_ctx=7, tied_head=True, head_bias=False, activation="gelu",
                      layers=2, lengths=(4, 2)), id="learned-tied-nobias"),
    pytest.param(dict(pe="learned", tied_head=False, head_bias=False, norm="post"),
                 id="learned-untied-nobias-post"),
    pytest.param(dict(pe="sinusoidal", tied_head=True, head_bias=True, lengths=(3, 4)),
                 id="sinusoidal-tied-bias"),
]


@pytest.mark.parametrize("fields", GPT2_LIKE)
def test_learned_positions_and_tied_head_match_torch_at_random_parameters(fields):
    """W_E's gradient sums its embedding and head parts; W_pos rows past T get none."""
    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=5)
    grads = assert_matches_torch(params, tfmcli.make_inputs(cfg), cfg)
    if cfg.pe == "learned" and cfg.ctx > cfg.seq_len:
        assert np.all(grads["embed.W_pos"][cfg.seq_len:] == 0)


def test_torch_sinusoidal_matches_tfm():
    from tfmcli.engine.positional import sinusoidal

    for T, d in [(6, 6), (9, 7)]:
        np.testing.assert_allclose(sinusoidal(T, d), torch_sinusoidal(T, d).numpy(),
                                   rtol=0, atol=1e-12)


def test_reference_detects_a_changed_parameter():
    """The torch reference is sensitive: nudging one weight moves its loss off tfm's."""
    cfg = tfmcli.Config(lengths=(3, 2))
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    nudged = dict(params)
    # One entry: adding a constant to all of W_2 would shift every row of the residual stream
    # by a constant, which the next layer norm removes.
    nudged["blocks.0.ffn.W_2"] = params["blocks.0.ffn.W_2"].copy()
    nudged["blocks.0.ffn.W_2"][0, 0] += 1e-3
    loss, *_ = torch_run(nudged, inputs, cfg)
    assert abs(fwd.loss - loss.item()) / abs(loss.item()) > 1e-6
