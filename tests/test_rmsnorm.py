"""RMSNorm (``rms_norm=True``): the norm and its backward, and the model with it, against
central differences, the torch reference and Hugging Face's whole LLaMA (RMSNorm, rotary
attention, a SwiGLU MLP, every bias on), at random O(1) parameters; the fast path, the KV
cache and the logit lens with it; ``tfm ln``'s RMSNorm view.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_gradcheck_passes,
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    llama_from,
    llama_grads,
    ok,
    random_params,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.check.gradcheck import central_differences
from tfmcli.engine import ops
from tfmcli.engine.sizes import activation_shapes, memory_estimate, param_shapes


def rms_cfg(**fields):
    base = dict(d_model=8, heads=2, rms_norm=True, seq_len=5, lengths=(5, 3))
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the norm alone


def test_rms_norm_divides_by_the_root_mean_square_and_keeps_the_mean():
    x = np.array([[1.0, 2.0, 3.0, 6.0]])
    gamma = np.array([1.0, 2.0, 0.5, 1.0])
    y, cache = ops.rms_norm_forward(x, gamma, 0.0)
    rms = np.sqrt((1 + 4 + 9 + 36) / 4)
    assert_scaled_close(y, x / rms * gamma)
    # unlike layer norm, a shift of every entry is not taken out
    shifted, _ = ops.rms_norm_forward(x + 10.0, gamma, 0.0)
    assert np.abs(shifted - y).max() > 0.1
    assert cache.rstd[0, 0] == pytest.approx(1 / rms, rel=1e-15)


def test_rms_norm_backward_against_central_differences():
    """dx and dgamma at a random gamma, from a random upstream gradient."""
    rng = np.random.default_rng(0)
    x, dout = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    gamma = rng.uniform(0.5, 1.5, 6)
    dx, dgamma = ops.rms_norm_backward(dout, ops.rms_norm_forward(x, gamma, 1e-5)[1])

    def in_x(flat):
        return float((dout * ops.rms_norm_forward(flat.reshape(3, 6), gamma, 1e-5)[0]).sum())

    def in_gamma(g):
        return float((dout * ops.rms_norm_forward(x, g, 1e-5)[0]).sum())

    np.testing.assert_allclose(dx.ravel(), central_differences(in_x, x.ravel()), rtol=0, atol=1e-8)
    np.testing.assert_allclose(dgamma, central_differences(in_gamma, gamma), rtol=0, atol=1e-8)
    # layer norm's mean(dxhat) term would not belong here: dx does not sum to 0 along a row
    assert np.abs(dx.sum(axis=-1)).max() > 1e-3


# ---------------------------------------------------------------- the model


def test_parameters_lose_beta_and_the_trace_keeps_its_names():
    cfg = rms_cfg(layers=2)
    names = list(param_shapes(cfg))
    assert not [n for n in names if n.endswith(".beta")]
    assert {"blocks.0.ln1.gamma", "blocks.1.ln2.gamma", "ln_f.gamma"} <= set(names)
    layer = cfg.replace(rms_norm=False)
    assert len(param_shapes(layer)) - len(names) == 5   # ln1, ln2 of two blocks, and ln_f
    assert list(activation_shapes(cfg)) == list(activation_shapes(layer))
    assert memory_estimate(layer)["params"] - memory_estimate(cfg)["params"] == 5 * 8 * 8


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2),
                                    dict(activation="swiglu", pe="rope", layers=2)],
                         ids=["pre", "post-L2", "swiglu-rope-L2"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(rms_cfg(**fields))


def test_fast_path_equals_the_reference():
    cfg = rms_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), d_model=12, layers=2, norm="post")
    params = random_params(tfmcli.init_params(cfg), seed=6)
    inputs = tfmcli.make_inputs(cfg)
    assert_fast_equals_reference(cfg, params, inputs)


def test_kv_cache_and_logit_lens_use_the_rms_norm():
    cfg = rms_cfg(batch=1, seq_len=6, lengths=None, layers=2)
    params, _, fwd = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2])
    last = tfmcli.explain.lens.logit_lens(params, fwd, cfg, row=0)[-1]   # the last block's output
    np.testing.assert_allclose(last.logits, fwd.acts["logits"][0], rtol=0, atol=1e-12)


def test_a_file_without_its_config_is_read_as_rms_norm_and_swiglu(tmp_path):
    """An npz of parameters alone: no beta means RMSNorm, a W_gate SwiGLU."""
    cfg = rms_cfg(activation="swiglu", lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    path = tmp_path / "bare.npz"
    np.savez(path, **{"param/" + name: value for name, value in params.items()})
    data = json.loads(ok("forward", "--load", path, "-T", 5, "--json").stdout)
    assert data["config"]["rms_norm"] is True and data["config"]["activation"] == "swiglu"
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg.replace(batch=2)), cfg)
    assert data["loss"] == pytest.approx(fwd.loss, rel=1e-12)


# ---------------------------------------------------------------- the oracles


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", layers=2), dict(dtype="float32", activation="swiglu")):
        rows = torch_reference_rows(rms_cfg(**fields), seed=9)
        assert any(r.name == "grad blocks.0.ln1.gamma" for r in rows)
        if fields.get("dtype") != "float32":   # b_K's gradient, 0 but for rounding, aside
            assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_matches_hugging_face_llama_at_random_parameters():
    """The whole LLaMA block (--rms-norm --activation swiglu --pe rope --no-head-bias): loss,
    logits and the gradient of every parameter, every bias and gamma drawn, against LLaMA's
    autograd, padding included."""
    pytest.importorskip("torch")
    cfg = rms_cfg(layers=2, pe="rope", activation="swiglu", head_bias=False, d_ff=12)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    model = llama_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


# ---------------------------------------------------------------- the view


def test_ln_view_lays_out_rms_norm():
    data = json.loads(ok("ln", "--rms-norm", "--layer", "ln2", "-t", 1, "--json").stdout)
    x = np.array(data["x"])
    assert data["rms_norm"] is True and data["mean"] == 0.0
    assert data["var"] == pytest.approx((x * x).mean(), rel=1e-14)   # the mean square
    assert_scaled_close(data["xhat"], x / np.sqrt((x * x).mean() + 1e-5))
    assert data["y_model_diff"] < 1e-14 and data["dx_numeric_diff"] < 1e-8
    assert not json.loads(ok("ln", "--layer", "ln2", "-t", 1, "--json").stdout)["rms_norm"]
    text = ok("ln", "--rms-norm", "-t", 1).stdout
    assert "dx = (dxhat - xhat * m2) / sqrt(mean(x^2) + eps)" in text
    def beta_rows(out):
        return [line for line in out.splitlines() if line.strip().startswith("beta ")]

    assert not beta_rows(text) and beta_rows(ok("ln", "-t", 1).stdout)   # layer norm's has one
