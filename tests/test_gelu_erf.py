"""GELU itself (``--activation gelu_erf``): ``x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))``, BERT's and
Pythia's, where tfm's ``gelu`` is the tanh form. ``ops.erf`` and the fast path's erf
(``erf_series``) against ``math.erf`` and known values; the activation and its slope against
torch's ``F.gelu`` and central differences; the model at random O(1) parameters against central
differences, the fast path, the torch reference and Hugging Face's GPT-NeoX with ``hidden_act``
"gelu"; the command line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_gradcheck_passes,
    assert_scaled_close,
    neox_from,
    ok,
    random_params,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine import erf_series, ops


def test_erf_is_maths_erf_entry_by_entry_across_chunks():
    """Past one chunk (the chunk's edge and the last partial chunk included), in the input's
    dtype and shape; the ends and nan as math.erf has them."""
    x = np.random.default_rng(0).normal(scale=3.0, size=(3, ops.ERF_CHUNK // 2 + 5))
    got = ops.erf(x)
    assert got.shape == x.shape and got.dtype == np.float64
    np.testing.assert_array_equal(got, [[math.erf(v) for v in row] for row in x])
    x32 = x[:, :7].astype(np.float32)
    assert ops.erf(x32).dtype == np.float32
    np.testing.assert_array_equal(ops.erf(x32), np.float32([[math.erf(v) for v in row]
                                                            for row in x32]))
    ends = ops.erf(np.array([0.0, -np.inf, np.inf, np.nan, 30.0]))
    assert ends[:3].tolist() == [0.0, -1.0, 1.0] and np.isnan(ends[3]) and ends[4] == 1.0
    assert ops.erf(np.zeros((0, 4))).shape == (0, 4)


def test_erf_series_is_within_two_ulp_of_maths_erf():
    """The fast path's erf (``erf_series``) on a fine grid over [-7, 7] (both series, the
    seam at 1, the cut at 6), random entries over chunks, and tiny ones: within 2 ulp of
    math.erf, 9 in 10 the same bits; tiny x keep their relative accuracy; float32 as math.erf
    rounded; the ends as math.erf has them."""
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-7.0, 7.0, 140_001), [1.0, -1.0, np.nextafter(1.0, 0.0)],
                        rng.normal(scale=2.0, size=erf_series.CHUNK + 3)])
    want = ops.erf(x)
    got = erf_series.erf(x)
    ulps = np.abs(got - want) / np.spacing(np.abs(want))
    assert ulps.max() <= 2.0 and np.mean(got == want) > 0.85
    tiny = np.geomspace(1e-300, 1e-3, 500) * np.where(np.arange(500) % 2, 1.0, -1.0)
    np.testing.assert_allclose(erf_series.erf(tiny), ops.erf(tiny), rtol=4e-16, atol=0)
    x32 = rng.normal(scale=2.0, size=(40, 50)).astype(np.float32)
    assert erf_series.erf(x32).dtype == np.float32
    np.testing.assert_array_equal(erf_series.erf(x32), ops.erf(x32))
    ends = erf_series.erf(np.array([0.0, -0.0, -np.inf, np.inf, np.nan, 6.0, -30.0]))
    assert ends.tolist()[:4] == [0.0, 0.0, -1.0, 1.0] and np.signbit(ends[1])
    assert np.isnan(ends[4]) and ends[5:].tolist() == [1.0, -1.0]
    assert erf_series.erf(np.zeros((0, 4))).shape == (0, 4)


def test_the_fast_path_takes_the_series_and_the_reference_maths_erf():
    """The FFN's GELU on each path, bit for bit: the fast path's through erf_series, the
    reference's through math.erf (which differ on some of these entries)."""
    cfg = erf_cfg(d_model=16, seq_len=40, dtype="float64")
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    for fast, erf_of in ((True, erf_series.erf), (False, ops.erf)):
        acts = tfmcli.forward(params, inputs, cfg, fast=fast).acts
        pre = acts["blocks.0.ffn.pre"]
        np.testing.assert_array_equal(acts["blocks.0.ffn.act"],
                                      pre * (0.5 * (1.0 + erf_of(pre * math.sqrt(0.5)))))
    assert np.any(erf_series.erf(pre * math.sqrt(0.5)) != ops.erf(pre * math.sqrt(0.5)))


def test_gelu_erf_at_known_points():
    """x Phi(x): Phi(1) = 0.8413447460685429, Phi(-1) its complement, Phi(0) = 1/2; far out
    GELU is x itself, or 0; it differs from the tanh form by up to 4.7e-4 (at x = -2.7)."""
    y, _ = ops.gelu_erf_forward(np.array([1.0, -1.0, 0.0, 10.0, -10.0]))
    np.testing.assert_allclose(y, [0.8413447460685429, -0.15865525393145707, 0.0, 10.0, -0.0],
                               rtol=1e-15, atol=1e-22)
    x = np.linspace(-6, 6, 1201)
    gap = np.abs(ops.gelu_erf_forward(x)[0] - ops.gelu_forward(x)[0]).max()
    assert 1e-4 < gap < 1e-3


def test_gelu_erf_and_its_backward_match_torch_and_central_differences():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x, dout = rng.normal(scale=2.0, size=(4, 50)), rng.normal(size=(4, 50))
    y, cache = ops.gelu_erf_forward(x)
    dx = ops.gelu_erf_backward(dout, cache)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.gelu(xt)
    yt.backward(torch.tensor(dout))
    assert_scaled_close(y, yt.detach().numpy(), floor=1e-15)
    assert_scaled_close(dx, xt.grad.numpy(), floor=1e-15)
    h = 1e-6
    numeric = (ops.gelu_erf_forward(x + h)[0] - ops.gelu_erf_forward(x - h)[0]) / (2 * h)
    np.testing.assert_allclose(dx, dout * numeric, rtol=0, atol=1e-8)


def erf_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3),
                activation="gelu_erf")
    return tfmcli.Config(**{**base, **fields})


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", pe="rope", parallel_residual=False),
                                    dict(rms_norm=True, parallel_residual=True, pe="rope",
                                         rotary_dim=2, kv_heads=1)],
                         ids=["pre", "post-rope", "parallel-rms-partial"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(erf_cfg(**fields))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fast_path_equals_the_reference(dtype):
    cfg = erf_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, dtype=dtype)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    rows = torch_reference_rows(erf_cfg(), seed=8)
    assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_matches_hugging_face_gpt_neox_with_pythias_gelu():
    """GPT-NeoX as Pythia has it: ``hidden_act`` "gelu" (torch's exact GELU), parallel
    residual, a quarter of each head turned: loss, logits and the MLP's gradients to 1e-12;
    tfm's tanh form would miss its logits."""
    pytest.importorskip("torch")
    cfg = erf_cfg(d_model=16, heads=2, head_bias=False, pe="rope", rotary_dim=2,
                  parallel_residual=True, seq_len=7, lengths=(7, 4))
    params = random_params(tfmcli.init_params(cfg), seed=9)
    neox = neox_from(params, cfg, 2, parallel=True)
    assert neox.config.hidden_act == "gelu"
    inputs = tfmcli.make_inputs(cfg)
    grads = tfm_grads_matching_hf(neox, params, inputs, cfg)
    for i, layer in enumerate(neox.gpt_neox.layers):
        for ours, theirs in ((f"blocks.{i}.ffn.W_1", layer.mlp.dense_h_to_4h.weight.grad.T),
                             (f"blocks.{i}.ffn.b_1", layer.mlp.dense_h_to_4h.bias.grad)):
            np.testing.assert_allclose(grads[ours], theirs.numpy(), rtol=0,
                                       atol=1e-12 * np.abs(theirs.numpy()).max(), err_msg=ours)
    tanh = tfmcli.forward(params, inputs, cfg.replace(activation="gelu"))
    exact = tfmcli.forward(params, inputs, cfg)
    assert np.abs(tanh.acts["logits"] - exact.acts["logits"]).max() > 1e-5


def test_the_activation_reaches_the_panel_the_ffn_view_and_train():
    panel = " ".join(ok("forward", "--activation", "gelu_erf").stdout.replace("│", " ").split())
    assert "activation gelu_erf (exact: 0.5 x (1 + erf(x / sqrt 2)))" in panel
    shown = " ".join(ok("ffn", "--activation", "gelu_erf").stdout.split())
    assert "gelu_erf(pre) = pre Phi(pre) = 0.5 pre (1 + erf(pre / sqrt 2))" in shown
    data = json.loads(ok("ffn", "--activation", "gelu_erf", "--json").stdout)
    pre = np.array(data["pre"])
    assert_scaled_close(data["hidden"], [v * 0.5 * (1 + math.erf(v / math.sqrt(2)))
                                             for v in pre], floor=1e-15)
    trained = json.loads(ok("train", "--steps", 2, "--activation", "gelu_erf", "--json").stdout)
    assert trained["config"]["activation"] == "gelu_erf"
