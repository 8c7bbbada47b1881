"""ALiBi (``pe="alibi"``, ``--pe alibi``): head h adds ``-m_h (i - j)`` to its scaled score of
query i at key j (Press, Smith and Lewis 2022; BLOOM, MPT). The slopes, the scores written out by
hand, a pattern that is the bias alone, central differences at random O(1) parameters, the fast
path, the torch reference (BLOOM's ``m_h j`` form), the KV cache, and the command line.
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
    decoded_like_the_forward,
    error_line,
    ok,
    random_params,
    run,
    torch_reference_rows,
)
from tfmcli.engine.positional import alibi_bias, alibi_slopes

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def alibi_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3), pe="alibi")
    return tfmcli.Config(**{**base, **fields})


@pytest.mark.parametrize("heads, exponents", [
    (1, [8]),
    (2, [4, 8]),
    (4, [2, 4, 6, 8]),
    (8, [1, 2, 3, 4, 5, 6, 7, 8]),
    # not a power of two: 8's sequence, then every other of 16's (2^-0.5, 2^-1.5, ...)
    (12, [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]),
    (3, [4, 8, 2]),
])
def test_the_slopes_are_the_papers(heads, exponents):
    np.testing.assert_array_equal(alibi_slopes(heads), 2.0 ** -np.array(exponents))


def test_the_bias_is_minus_the_slope_times_the_distance():
    bias = alibi_bias(4, 2)
    assert bias.shape == (2, 4, 4)
    np.testing.assert_array_equal(bias[0, 3], [-3 / 16, -2 / 16, -1 / 16, 0])
    np.testing.assert_array_equal(bias[1, 2], [-2 / 256, -1 / 256, 0, 1 / 256])   # key 3: ahead


def test_a_head_with_zero_queries_attends_by_the_bias_alone():
    """W_Q = 0 makes every score 0: each row's weights are the softmax of -m (i - j) over the
    keys it sees, e^(-m (i - j)) / sum, written out here for m = 1/16 and 1/256."""
    cfg = alibi_cfg(layers=1)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    params["blocks.0.attn.W_Q"] = np.zeros_like(params["blocks.0.attn.W_Q"])
    params["blocks.0.attn.b_Q"] = np.zeros_like(params["blocks.0.attn.b_Q"])
    for fast in (True, False):
        pattern = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg,
                                 fast=fast).acts["blocks.0.attn.pattern"]
        for head, m in ((0, 1 / 16), (1, 1 / 256)):
            weights = np.exp([-2 * m, -m, 0.0])
            assert_scaled_close(pattern[0, head, 2, :3], weights / weights.sum())
            # row 1 has 3 tokens: query 4 (padding) sees keys 0..2, its distances 4, 3, 2
            weights = np.exp([-4 * m, -3 * m, -2 * m])
            assert_scaled_close(pattern[1, head, 4, :3], weights / weights.sum())
            assert (pattern[0, head, 2, 3:] == 0).all()


@pytest.mark.parametrize("fields", [dict(), dict(attn_softcap=2.0), dict(kv_heads=1, heads=4)],
                         ids=["plain", "capped", "grouped"])
def test_the_scores_are_q_k_scaled_plus_the_bias(fields):
    """The model's attn.scores written out by hand: q k^T / sqrt(d_head) - m_h (i - j), then
    capped, -inf where the mask hides a key."""
    cfg = alibi_cfg(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg)
    p, H = "blocks.1.attn.", cfg.heads
    q, k = fwd.acts[p + "q"], np.repeat(fwd.acts[p + "k"], cfg.group, axis=1)
    T = q.shape[2]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    m = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(cfg.d_head) - m[:, None, None] * (i - j)
    if cfg.attn_softcap is not None:
        scores = 2.0 * np.tanh(scores / 2.0)
    seen = (j <= i) & (j < np.array([5, 3])[:, None, None, None])
    assert_scaled_close(np.where(seen, fwd.acts[p + "scores"], 0),
                        np.where(seen, scores, 0), floor=1e-13)
    assert np.isneginf(fwd.acts[p + "scores"][~np.broadcast_to(seen, scores.shape)]).all()


@pytest.mark.parametrize("fields", [
    dict(),
    dict(norm="post", attn_softcap=3.0),
    dict(heads=4, kv_heads=2, sliding_window=3, rms_norm=True, activation="swiglu"),
    dict(heads=3, d_model=9, causal=False),
], ids=["pre", "post-capped", "grouped-sliding", "three-heads-bidirectional"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(alibi_cfg(**fields))


@pytest.mark.parametrize("fields", [
    dict(),
    dict(heads=6, kv_heads=2, sliding_window=100, attn_softcap=5.0),
    dict(dtype="float32"),
], ids=["float64", "grouped-sliding-capped", "float32"])
def test_fast_path_equals_the_reference(fields):
    cfg = alibi_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=24,
                    **{"heads": 4, **fields})
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


@pytest.mark.parametrize("fields", [dict(), dict(heads=3, d_model=9, kv_heads=1, norm="post"),
                                    dict(causal=False, heads=4)],
                         ids=["pre", "three-heads-grouped-post", "bidirectional"])
def test_matches_the_torch_reference_at_random_parameters(fields):
    """The reference adds BLOOM's m_h j, not -m_h (i - j): each row differs by a constant,
    and the patterns, the loss and every gradient agree."""
    rows = torch_reference_rows(alibi_cfg(**fields), seed=8)
    # b_K's gradient is 0 but for rounding (a shift of every key): compare's own bar holds it
    assert max(r.rel for r in rows if not r.name.endswith("attn.b_K")) < 1e-12


def test_the_torch_reference_is_not_blind_to_the_bias():
    """tfm without the bias (its sinusoid-free twin, pe none) fails against the ALiBi reference."""
    torch = pytest.importorskip("torch")   # noqa: F841
    from tfmcli.check import reference

    cfg = alibi_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=8)
    inputs = tfmcli.make_inputs(cfg)
    plain = cfg.replace(pe="none")
    fwd = tfmcli.forward(params, inputs, plain)
    rows = reference.compare(fwd, tfmcli.backward(params, fwd, plain),
                             reference.torch_run(params, inputs, cfg), cfg)
    assert not all(r.passed for r in rows)


@pytest.mark.parametrize("fields", [dict(), dict(sliding_window=3, heads=4, kv_heads=2)],
                         ids=["full", "sliding-grouped"])
def test_the_kv_cache_decodes_like_the_forward(fields):
    cfg = alibi_cfg(batch=1, seq_len=7, lengths=None, **fields)
    decoded_like_the_forward(cfg, seed=5, tokens=[3, 1, 4, 1, 5, 9, 2])


# ---------------------------------------------------------------- the command line


def test_the_run_the_panel_and_the_views_take_alibi():
    data = json.loads(ok("forward", "--pe", "alibi", "--json").stdout)
    assert data["config"]["pe"] == "alibi"
    panel = " ".join(ok("forward", "--pe", "alibi").stdout.replace("│", " ").split())
    assert "positional alibi (slopes 1/16, 1/256)" in panel
    checked = json.loads(ok("check", "--against", "torch", "--pe", "alibi", "-H", 3, "-d", 6,
                            "--json").stdout)
    assert checked["passed"] is True
    trained = json.loads(ok("train", "--steps", 2, "--pe", "alibi", "--json").stdout)
    assert trained["config"]["pe"] == "alibi"


def test_the_head_steps_show_the_bias():
    shown = " ".join(ok("attn", "--pe", "alibi", "--head", 1).stdout.split())
    assert "ALiBi scores (4, 4) scaled scores - m (i - j), m = 1/256" in shown
    data = json.loads(ok("attn", "--pe", "alibi", "--json").stdout)
    steps = {step["name"]: np.array(step["value"]) for step in data["steps"]}
    scaled, biased = steps["scaled scores"], steps["ALiBi scores"]
    T = scaled.shape[0]
    np.testing.assert_allclose(biased - scaled,
                               -(np.arange(T)[:, None] - np.arange(T)[None, :]) / 16, atol=1e-15)


def test_the_query_view_adds_the_bias_before_the_softmax():
    data = json.loads(ok("attn", "--pe", "alibi", "--query", 3, "--backward", "--json").stdout)
    keys = data["keys"]
    assert [k["alibi"] for k in keys] == [-3 / 16, -2 / 16, -1 / 16, 0.0]
    biased = np.array([k["scaled"] + k["alibi"] for k in keys])
    weights = np.exp(biased - biased.max())
    np.testing.assert_allclose([k["weight"] for k in keys], weights / weights.sum(), rtol=1e-12)
    assert data["backward"]["dq_numeric_diff"] < 1e-8   # central differences through the bias


def test_pe_alibi_shows_the_slopes_and_the_bias():
    data = json.loads(ok("pe", "--alibi", "-H", 12, "--len", 5, "--json").stdout)
    np.testing.assert_array_equal(data["slopes"], alibi_slopes(12))
    assert np.array(data["bias"]).shape == (12, 5, 5) and data["bias"][8][4][0] == -4 * 2 ** -0.5
    shown = " ".join(ok("pe", "--alibi", "-H", 12, "--len", 5).stdout.split())
    assert "11 2^-3.5 0.0883883" in shown and "head 7's bias, m = 1/256" in shown
    for args, flag in ((["--alibi", "-d", 4], "'--d-model'"), (["-H", 4], "'--heads'"),
                       (["--alibi", "--rope"], "'--alibi'")):
        assert flag in error_line(run("pe", *args), 2)


def test_the_rope_options_with_alibi_are_refused():
    line = error_line(run("forward", "--pe", "alibi", "--rope-theta", 500000), 2)
    assert "'--rope-theta'" in line and line.endswith("add --pe rope")
