"""Soft caps (``attn_softcap``, ``logit_softcap``; ``--attn-softcap``, ``--logit-softcap``):
Gemma 2's ``c tanh(x / c)`` on the attention scores and on the head's logits. The forward, the
backward at random O(1) parameters against central differences, the fast path against the
reference, the torch reference and the KV cache; the caps' slope; the views and flags.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_gradcheck_passes,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    ok,
    random_params,
    run,
    torch_reference_rows,
)
from tfmcli.engine import ops
from tfmcli.engine.sizes import memory_estimate


def capped_cfg(**fields):
    """Caps near the size of random O(1) parameters' scores and logits, so that some are
    squashed hard and some barely."""
    base = dict(d_model=8, heads=2, seq_len=5, lengths=(5, 3), attn_softcap=1.5,
                logit_softcap=2.0)
    return tfmcli.Config(**{**base, **fields})


def test_softcap_is_c_tanh_x_over_c_and_its_slope_is_one_minus_tanh_squared():
    x = np.array([-100.0, -3.0, -0.5, 0.0, 1e-9, 2.0, 40.0])
    capped = ops.softcap_forward(x, 2.0)
    np.testing.assert_array_equal(capped, 2.0 * np.tanh(x / 2.0))
    assert np.all(np.abs(capped) <= 2.0) and capped[4] == pytest.approx(1e-9, rel=1e-12)
    h = 1e-6
    numeric = (ops.softcap_forward(x + h, 2.0) - ops.softcap_forward(x - h, 2.0)) / (2 * h)
    np.testing.assert_allclose(ops.softcap_slope(capped, 2.0), numeric, rtol=1e-8, atol=1e-12)
    hidden = np.array([-np.inf, 1.0])   # a hidden key's score: slope 0, not nan
    np.testing.assert_array_equal(ops.softcap_slope(hidden, 2.0), [0.0, 1 - 0.25])


def test_the_scores_and_logits_are_the_capped_ones():
    cfg = capped_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg, fast=False)
    plain = cfg.replace(attn_softcap=None, logit_softcap=None)
    raw = tfmcli.forward(params, fwd.inputs, plain, fast=False)
    # the first block sees the same input either way: its scores are the plain ones, capped
    scores, raw_scores = fwd.acts["blocks.0.attn.scores"], raw.acts["blocks.0.attn.scores"]
    seen = np.isfinite(raw_scores)
    np.testing.assert_array_equal(np.isfinite(scores), seen)
    assert_scaled_close(scores[seen], 1.5 * np.tanh(raw_scores[seen] / 1.5))
    assert np.abs(raw_scores[seen]).max() > 1.5 > np.abs(scores[seen]).max()
    h = fwd.acts["ln_f.out"]
    z = h @ params["head.W_U"] + params["head.b_U"]
    assert_scaled_close(fwd.acts["logits"], 2.0 * np.tanh(z / 2.0))
    assert np.abs(z).max() > 2.0 > np.abs(fwd.acts["logits"]).max()


def test_the_logit_caps_gradient_is_the_slope_times_p_minus_y():
    """dW_U = h^T (dlogits * (1 - (logits / c)^2)): the head's gradient goes through the cap."""
    cfg = capped_cfg(attn_softcap=None)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    slope = 1 - (fwd.acts["logits"] / 2.0) ** 2
    dz = grads.acts["logits"] * slope
    assert_scaled_close(grads["head.W_U"], np.einsum("btd,btv->dv", fwd.acts["ln_f.out"], dz))
    assert_scaled_close(grads["head.b_U"], dz.sum(axis=(0, 1)))


@pytest.mark.parametrize("fields", [
    dict(),
    dict(logit_softcap=None),
    dict(attn_softcap=None, tied_head=True),
    dict(norm="post", layers=2, pe="learned", activation="gelu"),
    dict(pe="rope", rms_norm=True, activation="geglu", bias=False, head_bias=False, kv_heads=1,
         sliding_window=3, embed_scale=True, tied_head=True),
], ids=["both", "scores", "logits-tied", "post-L2", "gemma-like"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(capped_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(sliding_window=5, kv_heads=1, pe="rope"),
                                    dict(dtype="float32")], ids=["causal", "window", "float32"])
def test_fast_path_equals_the_reference(fields):
    """T 300: three query blocks, the causal (and window's) keys skipped, capped in place."""
    cfg = capped_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), layers=2, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_kv_cache_equals_the_full_forward():
    decoded_like_the_forward(capped_cfg(batch=1, seq_len=6, lengths=None, layers=2,
                                        sliding_window=3), 7, [3, 1, 4, 1, 5, 2])


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(tied_head=True, pe="rope", kv_heads=1)):
        rows = torch_reference_rows(capped_cfg(**fields), seed=8)
        assert any(r.name == "grad logits" for r in rows)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_each_cap_changes_the_loss():
    """A model that dropped either cap would differ: the loss moves with each."""
    cfg = capped_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    loss = tfmcli.forward(params, inputs, cfg).loss
    for name in ("attn_softcap", "logit_softcap"):
        assert abs(tfmcli.forward(params, inputs, cfg.replace(**{name: None})).loss - loss) > 1e-3


def test_the_memory_estimate_counts_the_gradients_before_the_caps():
    """The head's dlogits before the cap is one (B, T, V) array of its own, made and let go
    in the head's backward, before any block's gradients exist: what it adds is what it holds
    past them; the fast backward's dscores before the cap one (B, H, T, T): transients the
    plain model has none of (tests/test_memory.py holds the estimate to the measured peak)."""
    cfg = capped_cfg(batch=2, seq_len=64, lengths=None, d_model=16, vocab=4096,
                     attn_softcap=None)
    assert memory_estimate(cfg.replace(logit_softcap=None))["transient"] == 0
    estimate = memory_estimate(cfg)
    params, dacts = estimate["params"] // 8, estimate["activation grads"] // 8
    btv, btd = 2 * 64 * 4096, 2 * 64 * 16
    head = btv - (params - 4096 * 16) - (dacts - 2 * btv - btd)   # blocks' gradients not yet
    assert estimate["transient"] == head * 8 and 0 < head < btv
    cfg = cfg.replace(attn_softcap=50.0, logit_softcap=None, vocab=8)
    assert memory_estimate(cfg)["transient"] == 2 * 2 * 64 * 64 * 8


def test_the_config_refuses_a_cap_that_is_not_a_positive_number():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(tfmcli.ConfigError, match="attn_softcap must be a positive finite"):
            capped_cfg(attn_softcap=bad)
    assert capped_cfg(logit_softcap=30).logit_softcap == 30.0
    assert isinstance(capped_cfg(logit_softcap=30).logit_softcap, float)


# ---------------------------------------------------------------- the command line


def test_the_flags_reach_the_run_and_the_panel():
    data = json.loads(ok("forward", "--attn-softcap", 50, "--logit-softcap", 30, "--json").stdout)
    assert data["config"]["attn_softcap"] == 50.0 and data["config"]["logit_softcap"] == 30.0
    text = ok("forward", "--attn-softcap", 50, "--logit-softcap", 30).stdout
    assert "50 tanh(s / 50)" in text and "30 tanh(z / 30)" in text
    assert "tanh" not in ok("forward").stdout
    data = json.loads(ok("train", "--logit-softcap", 3, "--steps", 2, "--json").stdout)
    assert data["config"]["logit_softcap"] == 3.0


@pytest.mark.parametrize("flag", ["--attn-softcap", "--logit-softcap"])
def test_a_cap_that_is_not_positive_is_a_usage_error(flag):
    line = error_line(run("forward", flag, 0), 2)
    assert f"'{flag}'" in line and "must be a positive finite number, got 0.0" in line


# ---------------------------------------------------------------- the views


def test_tfm_attn_caps_the_heads_scores_and_goes_back_through_the_slope():
    data = json.loads(ok("attn", "--attn-softcap", 0.5, "--backward", "--json").stdout)
    steps = {s["name"]: np.array(s["value"], dtype=float) for s in data["steps"]}
    names = [s["name"] for s in data["steps"]]
    assert names.index("capped scores") == names.index("scaled scores") + 1
    capped = 0.5 * np.tanh(steps["scaled scores"] / 0.5)
    assert_scaled_close(steps["capped scores"], capped)
    seen = np.isfinite(steps["masked scores"])
    np.testing.assert_array_equal(steps["masked scores"][seen], steps["capped scores"][seen])
    back = {s["name"]: np.array(s["value"], dtype=float) for s in data["backward_steps"]}
    assert_scaled_close(back["dscaled scores"], back["dcapped scores"] * (1 - (capped / 0.5) ** 2))
    assert data["backward_model_diff"] < 1e-15   # dcapped against the model's attn.scores'
    plain = json.loads(ok("attn", "--backward", "--json").stdout)
    assert "capped scores" not in [s["name"] for s in plain["steps"]]
    assert "dcapped scores" not in [s["name"] for s in plain["backward_steps"]]


def test_tfm_attn_query_shows_each_capped_score_and_its_slope():
    data = json.loads(ok("attn", "--attn-softcap", 0.5, "--query", 3, "--backward",
                         "--json").stdout)
    keys = data["keys"]
    scaled = np.array([k["scaled"] for k in keys])
    capped = np.array([k["capped"] for k in keys])
    assert_scaled_close(capped, 0.5 * np.tanh(scaled / 0.5))
    weights = np.exp(capped) / np.exp(capped).sum()   # query 3 of 4 sees every key
    assert_scaled_close([k["weight"] for k in keys], weights)
    back = data["backward"]
    for key, c in zip(back["keys"], capped):
        assert key["slope"] == pytest.approx(1 - (c / 0.5) ** 2, rel=1e-14)
        assert key["dscaled"] == pytest.approx(key["dcapped"] * key["slope"], rel=1e-14)
        assert key["dscore"] == pytest.approx(key["dscaled"] * data["scale"], rel=1e-14)
    assert back["dq_numeric_diff"] < 1e-9 and back["dq_model_diff"] < 1e-15
    assert back["dscaled_model_diff"] < 1e-15
    text = ok("attn", "--attn-softcap", 0.5, "--query", 3, "--backward").stdout
    assert "capped (0.5 tanh(scaled / 0.5))" in text and "dcapped = weight x" in text


def test_tfm_loss_shows_z_the_capped_logits_and_dz():
    data = json.loads(ok("loss", "--logit-softcap", 1, "--json").stdout)
    z, logits = np.array(data["z"]), np.array(data["logits"])
    assert_scaled_close(logits, np.tanh(z))
    assert_scaled_close(data["dz"], np.array(data["dlogits"]) * (1 - logits ** 2))
    assert data["forward_model_diff"] < 1e-15 and data["dh_model_diff"] < 1e-15
    assert data["dh_numeric_diff"] < 1e-8   # central differences through the cap
    assert "z" not in json.loads(ok("loss", "--json").stdout)
    text = ok("loss", "--logit-softcap", 1).stdout
    assert "tanh(z / 1) (the cap)" in text and "is h^T dz (d x V), of db_U dz" in text


def test_the_logit_lens_caps_its_logits_as_the_head_does():
    """The last stream read through ln_f and the head is the model's own logits, capped."""
    cfg = capped_cfg(logit_softcap=0.7)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    last = tfmcli.explain.lens.logit_lens(params, fwd, cfg, row=1)[-1]
    assert_scaled_close(last.logits, fwd.acts["logits"][1])
    assert np.abs(last.logits).max() < 0.7


def test_the_logit_lens_caps_a_stream_at_a_time():
    """Every stream's logits are made in one product, then capped a stream at a time in
    place: a capped lens holds no more than an uncapped one (tracemalloc), where capping the
    stacked logits at once made two temporaries of them all (3x the peak); each stream's
    logits are its own stream through the head, capped."""
    import tracemalloc

    from tfmcli.engine.model import head_logits
    from tfmcli.explain.lens import logit_lens

    peaks = {}
    for cap in (None, 30.0):
        cfg = tfmcli.Config(layers=6, vocab=8000, seq_len=16, batch=1, d_model=16, heads=2,
                            logit_softcap=cap)
        params = random_params(tfmcli.init_params(cfg), seed=3)
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        logit_lens(params, fwd, cfg, 0)
        tracemalloc.start()
        try:
            rows = logit_lens(params, fwd, cfg, 0)
            peaks[cap] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        x = ops.layer_norm_forward(fwd.acts["blocks.2.out"][0], params["ln_f.gamma"],
                                   params["ln_f.beta"], cfg.eps)[0]
        assert_scaled_close(rows[3].logits, head_logits(x, params, cfg))
    assert peaks[30.0] < 1.2 * peaks[None]


def test_tfm_embed_takes_a_tied_heads_part_through_the_cap():
    """Tied, W_E's row gets the head's sum of dz h, dz = dlogits x the cap's slope: checked
    against the backward pass and against central differences of the loss."""
    data = json.loads(ok("embed", "--tied-head", "--logit-softcap", 1, "--json").stdout)
    assert data["dW_E_model_diff"] < 1e-15 and data["dW_E_numeric_diff"] < 1e-8
    assert "dz = dlogits x (1 -" in ok("embed", "--tied-head", "--logit-softcap", 1).stdout
