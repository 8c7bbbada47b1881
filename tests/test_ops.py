"""Every primitive's backward against float64 central differences.

Each op ``f`` is checked through the fake loss ``L = (f(...) * dout).sum()`` with a random
``dout``: its exact gradient with respect to each input is what ``*_backward(dout, cache)`` must
return, and ``(L(x + h) - L(x - h)) / 2h`` estimates it entry by entry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import assert_scaled_close
from tfmcli import IGNORE
from tfmcli.engine import ops
from tfmcli.engine.masks import combined_mask

TOL = 1e-7
STEP = 1e-6


def numerical_grad(loss, x, h=STEP):
    """Central differences of the scalar ``loss()`` with respect to every entry of ``x``.

    ``x`` is nudged in place (through a flat view) and restored after each entry.
    """
    assert x.flags.c_contiguous and x.dtype == np.float64
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        original = flat[i]
        flat[i] = original + h
        plus = loss()
        flat[i] = original - h
        minus = loss()
        flat[i] = original
        gflat[i] = (plus - minus) / (2 * h)
    return grad


def rel_err(analytic, numeric):
    """max |a - n| / max |n|: the largest error relative to the gradient's own size."""
    scale = max(float(np.abs(numeric).max()), 1e-300)
    return float(np.abs(analytic - numeric).max()) / scale


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


# ---------------------------------------------------------------- linear


def test_linear_forward_is_x_at_W_plus_b(rng):
    x, W, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5)), rng.normal(size=5)
    out, _ = ops.linear_forward(x, W, b)
    assert out.shape == (2, 3, 5)
    expected = np.einsum("bti,io->bto", x, W, optimize=True) + b
    assert_scaled_close(out, expected, floor=1e-13)


def test_linear_backward_matches_central_differences(rng):
    x, W, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5)), rng.normal(size=5)
    dout = rng.normal(size=(2, 3, 5))

    def loss():
        return float((ops.linear_forward(x, W, b)[0] * dout).sum())

    _, cache = ops.linear_forward(x, W, b)
    dx, dW, db = ops.linear_backward(dout, cache)
    assert (dx.shape, dW.shape, db.shape) == (x.shape, W.shape, b.shape)
    assert rel_err(dx, numerical_grad(loss, x)) <= TOL
    assert rel_err(dW, numerical_grad(loss, W)) <= TOL
    assert rel_err(db, numerical_grad(loss, b)) <= TOL


# ---------------------------------------------------------------- layer norm


def test_layer_norm_forward_normalises_each_row(rng):
    x = 3.0 * rng.normal(size=(2, 3, 5)) + 1.5
    gamma, beta = rng.normal(size=5), rng.normal(size=5)
    out, cache = ops.layer_norm_forward(x, gamma, beta, eps=1e-5)
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)                      # biased, as in torch's layer_norm
    assert_scaled_close(out, (x - mu) / np.sqrt(var + 1e-5) * gamma + beta, floor=1e-13)
    np.testing.assert_allclose(cache.xhat.mean(-1), 0.0, atol=1e-14)
    assert_scaled_close(cache.rstd, 1 / np.sqrt(var + 1e-5))


def test_layer_norm_backward_matches_central_differences(rng):
    x = 3.0 * rng.normal(size=(2, 3, 5)) + 1.5
    gamma, beta = rng.normal(size=5), rng.normal(size=5)
    dout = rng.normal(size=(2, 3, 5))

    def loss():
        return float((ops.layer_norm_forward(x, gamma, beta, 1e-5)[0] * dout).sum())

    _, cache = ops.layer_norm_forward(x, gamma, beta, 1e-5)
    dx, dgamma, dbeta = ops.layer_norm_backward(dout, cache)
    assert rel_err(dx, numerical_grad(loss, x)) <= TOL
    assert rel_err(dgamma, numerical_grad(loss, gamma)) <= TOL
    assert rel_err(dbeta, numerical_grad(loss, beta)) <= TOL


def seed003_layer_norm_dx(dghat, ghat, eps=1e-5):
    """Seed 003's layer-norm backward, transcribed literally (cells In [60]-[64]).

    Its three departures from the correct formula: sigma is the std of the *output* ghat, not of
    the input; it is squared without a square root, 1 / (d (sigma^2 + eps)); and the last term
    uses ``np.sum(sum_dghat)`` where ``sum(dghat * ghat)`` was meant. It also ignores gamma.
    """
    d = ghat.shape[-1]
    sum_dghat = np.sum(dghat, axis=-1, keepdims=True)
    sum_dghat_ghat = np.sum(sum_dghat, axis=-1, keepdims=True)   # the note's slip
    sigma = np.std(ghat, axis=-1, keepdims=True)
    inv_deriv = 1 / (d * (sigma**2 + eps))
    return inv_deriv * (d * dghat - sum_dghat - ghat * sum_dghat_ghat)


def test_layer_norm_backward_is_not_the_seed_003_formula(rng):
    # Same set-up as the note: a (2, 4, 6) input well away from unit variance, random gamma, beta.
    x = 2.0 + 0.4 * rng.random((2, 4, 6))
    gamma, beta = rng.random(6), rng.random(6)
    dghat = rng.normal(size=(2, 4, 6))
    out, cache = ops.layer_norm_forward(x, gamma, beta, 1e-5)

    def loss():
        return float((ops.layer_norm_forward(x, gamma, beta, 1e-5)[0] * dghat).sum())

    numeric = numerical_grad(loss, x)
    ours, _, _ = ops.layer_norm_backward(dghat, cache)
    note = seed003_layer_norm_dx(dghat, out)
    assert rel_err(ours, numeric) <= TOL
    assert rel_err(note, numeric) > 0.5


# ---------------------------------------------------------------- activations


def test_relu_backward_matches_central_differences(rng):
    x = rng.normal(size=(3, 7))
    x[np.abs(x) < 1e-3] = 0.5          # keep every entry away from the kink
    dout = rng.normal(size=x.shape)

    def loss():
        return float((ops.relu_forward(x)[0] * dout).sum())

    out, cache = ops.relu_forward(x)
    np.testing.assert_array_equal(out, np.where(x > 0, x, 0.0))
    dx = ops.relu_backward(dout, cache)
    assert rel_err(dx, numerical_grad(loss, x)) <= TOL


def test_relu_derivative_at_zero_is_zero():
    x = np.array([-1.0, 0.0, 2.0])
    dx = ops.relu_backward(np.ones(3), ops.relu_forward(x)[1])
    np.testing.assert_array_equal(dx, [0.0, 0.0, 1.0])


def test_gelu_forward_is_the_tanh_approximation():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])
    expected = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
                for v in x]
    out, _ = ops.gelu_forward(x)
    np.testing.assert_allclose(out, expected, rtol=1e-15, atol=1e-16)
    assert out[4] == pytest.approx(0.8411919906082768, abs=1e-15)   # torch gelu(1, "tanh")


def test_gelu_backward_matches_central_differences(rng):
    x = 2.0 * rng.normal(size=(3, 7))
    dout = rng.normal(size=x.shape)

    def loss():
        return float((ops.gelu_forward(x)[0] * dout).sum())

    _, cache = ops.gelu_forward(x)
    dx = ops.gelu_backward(dout, cache)
    assert rel_err(dx, numerical_grad(loss, x)) <= TOL


# ---------------------------------------------------------------- softmax


def test_softmax_forward_rows_sum_to_one_and_survive_large_values(rng):
    x = rng.normal(size=(2, 3, 4))
    x[0, 0] += 1000.0                    # exp(1000) overflows without the per-row max
    p, _ = ops.softmax_forward(x)
    assert np.all(np.isfinite(p))
    assert_scaled_close(p.sum(-1), 1.0, floor=1e-15)
    e = np.exp(x[1, 2])
    assert_scaled_close(p[1, 2], e / e.sum())


def test_softmax_of_minus_inf_is_zero_with_zero_gradient():
    x = np.array([[1.0, -np.inf, 2.0, -np.inf]])
    p, cache = ops.softmax_forward(x)
    np.testing.assert_array_equal(p[0, [1, 3]], 0.0)
    assert_scaled_close(p[0, [0, 2]], [1 / (1 + math.e), math.e / (1 + math.e)])
    dx = ops.softmax_backward(np.array([[0.3, 5.0, -1.0, 7.0]]), cache)
    np.testing.assert_array_equal(dx[0, [1, 3]], 0.0)


def test_softmax_backward_matches_central_differences(rng):
    x = 2.0 * rng.normal(size=(2, 3, 5))
    dout = rng.normal(size=x.shape)

    def loss():
        return float((ops.softmax_forward(x)[0] * dout).sum())

    _, cache = ops.softmax_forward(x)
    dx = ops.softmax_backward(dout, cache)
    assert rel_err(dx, numerical_grad(loss, x)) <= TOL


# ---------------------------------------------------------------- attention


def attention_setup(rng):
    B, H, T, dh = 2, 2, 4, 3
    q, k, v = (rng.normal(size=(B, H, T, dh)) for _ in range(3))
    mask = combined_mask([4, 2], T, causal=True)[:, None]     # (B, 1, T, T)
    return q, k, v, mask, 1 / math.sqrt(dh)


def test_attention_forward_masks_scores_and_pattern(rng):
    q, k, v, mask, scale = attention_setup(rng)
    context, scores, cache = ops.attention_forward(q, k, v, mask, scale)
    full = np.broadcast_to(mask, scores.shape)
    assert context.shape == (2, 2, 4, 3) and scores.shape == (2, 2, 4, 4)
    np.testing.assert_array_equal(np.isneginf(scores), ~full)
    np.testing.assert_array_equal(cache.pattern[~full], 0.0)
    np.testing.assert_allclose(cache.pattern.sum(-1), 1.0, atol=1e-15)
    # Row (b=1, h=0, t=3) sees keys 0 and 1 only (length 2).
    s = q[1, 0, 3] @ k[1, 0, :2].T * scale
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert_scaled_close(context[1, 0, 3], w @ v[1, 0, :2])


def test_attention_backward_matches_central_differences(rng):
    q, k, v, mask, scale = attention_setup(rng)
    dcontext = rng.normal(size=q.shape)

    def loss():
        return float((ops.attention_forward(q, k, v, mask, scale)[0] * dcontext).sum())

    _, _, cache = ops.attention_forward(q, k, v, mask, scale)
    dq, dk, dv, dpattern, dscores = ops.attention_backward(dcontext, cache)
    assert rel_err(dq, numerical_grad(loss, q)) <= TOL
    assert rel_err(dk, numerical_grad(loss, k)) <= TOL
    assert rel_err(dv, numerical_grad(loss, v)) <= TOL
    assert_scaled_close(dpattern, dcontext @ v.swapaxes(-1, -2))


def test_attention_dscores_matches_central_differences_on_visible_scores(rng):
    q, k, v, mask, scale = attention_setup(rng)
    dcontext = rng.normal(size=q.shape)
    _, scores, cache = ops.attention_forward(q, k, v, mask, scale)
    *_, dscores = ops.attention_backward(dcontext, cache)
    visible = np.isfinite(scores)
    s = np.where(visible, scores, 0.0)   # perturb finite stand-ins, re-hide before the softmax

    def loss():
        pattern, _ = ops.softmax_forward(np.where(visible, s, -np.inf))
        return float(((pattern @ v) * dcontext).sum())

    numeric = numerical_grad(loss, s)
    assert rel_err(dscores, numeric) <= TOL
    np.testing.assert_array_equal(dscores[~visible], 0.0)


# ---------------------------------------------------------------- embedding


def test_embedding_backward_accumulates_repeated_tokens(rng):
    V, d = 7, 3
    tokens = np.array([[1, 3, 1, 1], [0, 3, 5, 1]])       # 1 four times, 3 twice; 2, 4, 6 never
    W_E = rng.normal(size=(V, d))
    dout = rng.normal(size=(2, 4, d))

    def loss():
        return float((ops.embedding_forward(tokens, W_E)[0] * dout).sum())

    out, cache = ops.embedding_forward(tokens, W_E)
    np.testing.assert_array_equal(out[0, 2], W_E[1])
    dW_E = ops.embedding_backward(dout, cache)
    assert dW_E.shape == (V, d)
    assert rel_err(dW_E, numerical_grad(loss, W_E)) <= TOL
    assert_scaled_close(dW_E[1], dout[0, 0] + dout[0, 2] + dout[0, 3] + dout[1, 3])
    np.testing.assert_array_equal(dW_E[[2, 4, 6]], 0.0)


# ---------------------------------------------------------------- cross-entropy


def ce_setup(rng):
    logits = 2.0 * rng.normal(size=(2, 4, 5))
    targets = rng.integers(0, 5, size=(2, 4))
    valid = np.array([[True, True, True, False], [True, False, False, False]])
    return logits, targets, valid


def test_cross_entropy_is_mean_over_valid_positions_only(rng):
    logits, targets, valid = ce_setup(rng)
    loss, probs, _ = ops.cross_entropy_forward(logits, targets, valid)
    terms = [np.log(np.exp(logits[b, t]).sum()) - logits[b, t, targets[b, t]]
             for b in range(2) for t in range(4) if valid[b, t]]
    assert loss == pytest.approx(sum(terms) / 4, rel=1e-14)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-15)
    # Changing logits at an invalid position leaves the loss untouched.
    changed = logits.copy()
    changed[1, 3] += 10.0
    assert ops.cross_entropy_forward(changed, targets, valid)[0] == loss


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_terms_are_the_losss_own_and_finite_where_p_underflows(rng, dtype):
    logits, targets, valid = ce_setup(rng)
    logits = logits.astype(dtype)
    targets[~valid] = IGNORE   # never read
    loss, probs, cache = ops.cross_entropy_forward(logits, targets, valid)
    terms = ops.cross_entropy_terms(logits, targets, valid)
    assert terms.shape == (2, 4) and terms.dtype == dtype
    assert float(terms.sum() / cache.n) == loss            # the same bits
    assert (terms[~valid] == 0).all()
    ids = np.where(valid, targets, 0)
    p = np.take_along_axis(probs, ids[..., None], axis=-1)[..., 0]
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(terms[valid], -np.log(p[valid]), rtol=rtol)
    # a target 800 below the best logit: p is 0 in float64, its term the gap (log-sum-exp)
    far = np.zeros((1, 1, 3))
    far[0, 0, 0] = 800.0
    term = ops.cross_entropy_terms(far, np.array([[1]]), np.array([[True]]))
    assert ops.cross_entropy_forward(far, np.array([[1]]), np.array([[True]]))[1][0, 0, 1] == 0
    assert term[0, 0] == pytest.approx(800.0, rel=1e-15)


def test_cross_entropy_of_a_one_word_vocabulary_never_reads_an_ignored_target():
    """V = 1: the only id is 0, so an ignored position (-100) must stand in as 0; the loss of
    a certain prediction is 0 and its gradient 0."""
    logits = np.array([[[0.5], [2.0]]])
    targets, valid = np.array([[0, IGNORE]]), np.array([[True, False]])
    loss, probs, cache = ops.cross_entropy_forward(logits, targets, valid)
    assert loss == 0.0 and probs.tolist() == [[[1.0], [1.0]]]
    assert ops.cross_entropy_backward(cache).tolist() == [[[0.0], [0.0]]]


def test_cross_entropy_backward_matches_central_differences(rng):
    logits, targets, valid = ce_setup(rng)

    def loss():
        return ops.cross_entropy_forward(logits, targets, valid)[0]

    _, _, cache = ops.cross_entropy_forward(logits, targets, valid)
    dlogits = ops.cross_entropy_backward(cache)
    assert rel_err(dlogits, numerical_grad(loss, logits)) <= TOL
    np.testing.assert_array_equal(dlogits[~valid], 0.0)
    np.testing.assert_allclose(dlogits.sum(-1), 0.0, atol=1e-16)


def test_cross_entropy_dprobs_matches_central_differences(rng):
    logits, targets, valid = ce_setup(rng)
    _, probs, cache = ops.cross_entropy_forward(logits, targets, valid)
    P = probs.copy()

    def loss():   # the loss written as a function of the probabilities themselves
        picked = np.take_along_axis(P, targets[..., None], axis=-1)[..., 0]
        return float(-(np.log(picked) * valid).sum() / valid.sum())

    # Some probabilities are ~1e-3, where log has a large third derivative: a smaller step.
    assert rel_err(ops.cross_entropy_dprobs(cache), numerical_grad(loss, P, h=1e-8)) <= TOL


def test_cross_entropy_is_finite_for_logits_of_size_1e4(rng):
    logits, targets, valid = ce_setup(rng)
    logits = logits * 5e3
    loss, probs, cache = ops.cross_entropy_forward(logits, targets, valid)
    assert np.isfinite(loss) and loss > 100
    assert np.all(np.isfinite(ops.cross_entropy_backward(cache)))


# ---------------------------------------------------------------- no op writes to its arguments


def _run_linear(rng):
    args = [rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5)), rng.normal(size=5)]
    dout = rng.normal(size=(2, 3, 5))
    return args, dout, lambda: ops.linear_backward(dout, ops.linear_forward(*args)[1])


def _run_layer_norm(rng):
    args = [rng.normal(size=(2, 3, 4)), rng.normal(size=4), rng.normal(size=4)]
    dout = rng.normal(size=(2, 3, 4))
    return args, dout, lambda: ops.layer_norm_backward(
        dout, ops.layer_norm_forward(*args, 1e-5)[1])


def _run_relu(rng):
    args = [rng.normal(size=(3, 4))]
    dout = rng.normal(size=(3, 4))
    return args, dout, lambda: ops.relu_backward(dout, ops.relu_forward(*args)[1])


def _run_gelu(rng):
    args = [rng.normal(size=(3, 4))]
    dout = rng.normal(size=(3, 4))
    return args, dout, lambda: ops.gelu_backward(dout, ops.gelu_forward(*args)[1])


def _run_softmax(rng):
    x = rng.normal(size=(3, 4))
    x[0, 1] = -np.inf
    dout = rng.normal(size=(3, 4))
    return [x], dout, lambda: ops.softmax_backward(dout, ops.softmax_forward(x)[1])


def _run_attention(rng):
    q, k, v, mask, scale = attention_setup(rng)
    dout = rng.normal(size=q.shape)
    return [q, k, v, mask], dout, lambda: ops.attention_backward(
        dout, ops.attention_forward(q, k, v, mask, scale)[2])


def _run_embedding(rng):
    tokens, W_E = np.array([[1, 1, 2], [0, 1, 3]]), rng.normal(size=(4, 3))
    dout = rng.normal(size=(2, 3, 3))
    return [tokens, W_E], dout, lambda: ops.embedding_backward(
        dout, ops.embedding_forward(tokens, W_E)[1])


def _run_cross_entropy(rng):
    logits, targets, valid = ce_setup(rng)

    def run():
        cache = ops.cross_entropy_forward(logits, targets, valid)[2]
        return ops.cross_entropy_backward(cache), ops.cross_entropy_dprobs(cache)

    return [logits, targets, valid], np.zeros(0), run


@pytest.mark.parametrize("make", [
    _run_linear, _run_layer_norm, _run_relu, _run_gelu, _run_softmax, _run_attention,
    _run_embedding, _run_cross_entropy,
], ids=lambda f: f.__name__.removeprefix("_run_"))
def test_ops_never_modify_inputs_or_dout(rng, make):
    args, dout, run = make(rng)
    before = [a.copy() for a in args] + [dout.copy()]
    run()
    for kept, now in zip(before, [*args, dout]):
        np.testing.assert_array_equal(now, kept)
