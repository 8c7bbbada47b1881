"""The embedding scaled by sqrt(d_model) (``embed_scale``, ``--embed-scale``): the Transformer
paper's (section 3.4) and Gemma's. The forward, the backward at random O(1) parameters against
central differences, its own reference path, the torch reference and the KV cache; ``tfm
embed``'s terms; a tied head reading W_E unscaled. Hugging Face's Gemma, which scales its
embedding so, holds it too (tests/test_gemma.py).
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
    ok,
    random_params,
    torch_reference_rows,
)
from tfmcli.engine.sizes import memory_estimate


def scaled_cfg(**fields):
    """d = 16: the scale is 4, exactly, in both dtypes."""
    base = dict(d_model=16, heads=2, seq_len=5, lengths=(5, 3), embed_scale=True)
    return tfmcli.Config(**{**base, **fields})


def test_the_embedding_is_sqrt_d_times_the_rows():
    cfg = scaled_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=1)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    np.testing.assert_array_equal(fwd.acts["embed"], 4.0 * params["embed.W_E"][inputs.tokens])
    np.testing.assert_array_equal(fwd.acts["blocks.0.in"], fwd.acts["embed"] + fwd.acts["pe"])
    assert cfg.embed_factor == 4.0 and cfg.replace(embed_scale=False).embed_factor == 1.0
    assert scaled_cfg(d_model=6).embed_factor == pytest.approx(6 ** 0.5, rel=1e-16)
    # float32: the scale is float32's sqrt(d), as the rows' own type (Gemma's in float32)
    cfg32 = scaled_cfg(d_model=6, dtype="float32")
    p32 = tfmcli.init_params(cfg32)
    fwd32 = tfmcli.forward(p32, tfmcli.make_inputs(cfg32), cfg32)
    assert fwd32.acts["embed"].dtype == np.float32
    np.testing.assert_array_equal(fwd32.acts["embed"],
                                  p32["embed.W_E"][fwd32.inputs.tokens] * np.float32(6 ** 0.5))


def test_the_lookups_gradient_is_scaled_and_a_tied_heads_is_not():
    """dW_E = sqrt(d) times each row's sum of dembed, plus (tied) the head's h^T dlogits
    unscaled: the head reads W_E as it is."""
    cfg = scaled_cfg(tied_head=True)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    h = fwd.acts["ln_f.out"]
    assert_scaled_close(fwd.acts["logits"], h @ params["embed.W_E"].T + params["head.b_U"])
    lookup = np.zeros_like(params["embed.W_E"])
    np.add.at(lookup, fwd.inputs.tokens.ravel(), grads.acts["embed"].reshape(-1, 16))
    head = np.einsum("btv,btd->vd", grads.acts["logits"], h)
    assert_scaled_close(grads["embed.W_E"], 4.0 * lookup + head, floor=1e-15)


def test_the_memory_estimate_is_unchanged():
    """The rows are scaled in the lookup's own copy: no array more."""
    cfg = scaled_cfg(batch=4, seq_len=32, lengths=None)
    assert memory_estimate(cfg) == memory_estimate(cfg.replace(embed_scale=False))


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2, pe="learned"),
                                    dict(tied_head=True, pe="rope", rms_norm=True,
                                         activation="geglu", bias=False, head_bias=False)],
                         ids=["pre-sinusoidal", "post-learned-L2", "tied-rope-geglu"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(scaled_cfg(d_model=8, **fields))
    assert "embed.W_E" in [c.name for c in report.params]


def test_fast_path_equals_the_reference():
    cfg = scaled_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), layers=2, tied_head=True)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_kv_cache_equals_the_full_forward():
    decoded_like_the_forward(scaled_cfg(batch=1, seq_len=6, lengths=None, layers=2), 7,
                             [3, 1, 4, 1, 5, 2])


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(tied_head=True, pe="rope"), dict(d_model=6, dtype="float32")):
        rows = torch_reference_rows(scaled_cfg(**fields), seed=8)
        assert any(r.name == "grad embed.W_E" for r in rows)
        if fields.get("dtype") != "float32":   # b_K's gradient, 0 but for rounding, aside
            assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_the_scale_changes_the_loss():
    """A model that dropped the scale would differ: the loss moves with it."""
    cfg = scaled_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    plain = cfg.replace(embed_scale=False)
    assert abs(tfmcli.forward(params, inputs, cfg).loss
               - tfmcli.forward(params, inputs, plain).loss) > 1e-3


# ---------------------------------------------------------------- the views


def test_embed_view_multiplies_the_row_and_its_gradient():
    """tfm embed --json: x0 = 4 W_E[id] + PE[t] and dW_E[id] = 4 sum(dx0), each against the run
    and against central differences of the loss."""
    args = ("embed", "--embed-scale", "-d", 16, "-t", 3, "--row", 1)
    data = json.loads(ok(*args, "--json").stdout)
    assert data["scale"] == 4.0
    w_e, pe = np.array(data["w_e"]), np.array(data["pe"])
    assert_scaled_close(data["x0"], 4 * w_e + pe, floor=1e-15)
    assert_scaled_close(data["embedding_part"], 4 * np.array(data["dx0"]).sum(axis=0))
    assert data["forward_model_diff"] < 1e-15 and data["dW_E_model_diff"] < 1e-15
    assert data["dW_E_numeric_diff"] < 1e-8
    plain = json.loads(ok(*args[:1], *args[2:], "--json").stdout)
    assert plain["scale"] == 1.0 and plain["w_e"] == data["w_e"]
    text = ok(*args).stdout
    assert "forward: x0 = sqrt(d) W_E[id] + PE[t]" in text
    assert "x sqrt(d)" in text and "sqrt(d) = sqrt(16) = 4" in text


def test_the_panel_and_train_take_it():
    assert "x sqrt(d) = 4 (embed = sqrt(d) W_E[id])" in ok("forward", "--embed-scale", "-d",
                                                           16).stdout
    assert "embed scale" not in ok("forward", "-d", 16).stdout
    data = json.loads(ok("train", "--embed-scale", "--steps", 3, "--json").stdout)
    assert data["config"]["embed_scale"] is True
