"""Layer norms without beta (``norm_bias`` false, ``--no-norm-bias``): MPT's norms,
``y = (x - mean) / sqrt(var + eps) * gamma``. The parameters, a norm's output written out by
hand, central differences at random O(1) parameters, the fast path, the torch reference, the KV
cache, ``tfm ln``, the refusal, the round trip and a file without its config.
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
from tfmcli.engine.sizes import param_shapes

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def plain_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3), pe="alibi",
                norm_bias=False)
    return tfmcli.Config(**{**base, **fields})


def test_no_norm_has_a_beta():
    every_norm = dict(embed_norm=True, qk_norm=True, sandwich_norm=True)
    with_beta = param_shapes(plain_cfg(norm_bias=True, **every_norm))
    without = param_shapes(plain_cfg(**every_norm))
    betas = [n for n in with_beta if n.endswith(".beta")]
    assert len(betas) == 1 + 2 * 6 + 1   # ln_embed, each block's six norms, ln_f
    assert list(without) == [n for n in with_beta if not n.endswith(".beta")]
    assert sum(np.prod(s) for s in with_beta.values()) - sum(
        np.prod(s) for s in without.values()) == 8 + 2 * (4 * 8 + 2 * 4) + 8
    assert plain_cfg().norm_biased is False and plain_cfg(norm_bias=True).norm_biased is True
    assert tfmcli.Config(rms_norm=True).norm_biased is False


def test_a_norm_without_beta_is_gamma_times_xhat():
    """blocks.0.ln1.out is (x - mean) / sqrt(var + eps) * gamma, written out here, and not what
    the same parameters give with a beta."""
    cfg = plain_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    for fast in (True, False):
        fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg, fast=fast)
        x = fwd.acts["blocks.0.in"]
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        y = (x - mean) / np.sqrt(var + cfg.eps) * params["blocks.0.ln1.gamma"]
        assert_scaled_close(fwd.acts["blocks.0.ln1.out"], y, floor=1e-13)
        h = fwd.acts["blocks.1.out"]
        mean, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        assert_scaled_close(fwd.acts["ln_f.out"],
                            (h - mean) / np.sqrt(var + cfg.eps) * params["ln_f.gamma"], floor=1e-13)
    grads = tfmcli.backward(params, fwd, cfg)
    assert set(grads) == set(params)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(norm="post", pe="sinusoidal", activation="gelu_erf", tied_head=True),
    dict(embed_norm=True, qk_norm=True, sandwich_norm=True, pe="rope", activation="swiglu"),
    dict(parallel_residual=True, bias=False, head_bias=False, kv_heads=1),
], ids=["alibi-pre", "post-tied", "every-norm-rope", "parallel-grouped"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(plain_cfg(**fields))
    names = {c.name for c in report.params}
    assert "blocks.0.ln1.gamma" in names and not [n for n in names if n.endswith(".beta")]


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32", norm="post", pe="none")],
                         ids=["float64", "float32-post"])
def test_fast_path_equals_the_reference(fields):
    cfg = plain_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", qk_norm=True, pe="rope", tied_head=True)):
        rows = torch_reference_rows(plain_cfg(**fields), seed=8)
        names = {r.name for r in rows}
        assert "grad blocks.0.ln1.gamma" in names and not [n for n in names if "beta" in n]
        assert max(r.rel for r in rows if not r.name.endswith("attn.b_K")) < 1e-12


def test_the_kv_cache_decodes_like_the_forward():
    decoded_like_the_forward(plain_cfg(batch=1, seq_len=6, lengths=None, embed_norm=True),
                             seed=5, tokens=[3, 1, 4, 1, 5, 9])


def test_rms_norm_is_refused():
    with pytest.raises(tfmcli.ConfigError, match="RMSNorm .rms_norm. has none to take"):
        plain_cfg(rms_norm=True)
    line = error_line(run("forward", "--rms-norm", "--no-norm-bias"), 2)
    assert "'--no-norm-bias'" in line and "has none to take" in line


# ---------------------------------------------------------------- the command line

def test_the_flag_reaches_the_run_the_panel_and_the_views():
    data = json.loads(ok("forward", "--no-norm-bias", "--json").stdout)
    assert data["config"]["norm_bias"] is False
    assert json.loads(ok("forward", "--json").stdout)["config"]["norm_bias"] is True
    panel = " ".join(ok("forward", "--no-norm-bias").stdout.replace("│", " ").split())
    assert "norm Pre-LN (+ final ln_f), layer norm without beta (gamma only)" in panel
    grads = json.loads(ok("backward", "--no-norm-bias", "--layer", "ln1", "--json").stdout)
    assert [g["name"] for g in grads["gradients"]] == ["blocks.0.ln1.gamma"]
    shown = json.loads(ok("ln", "--no-norm-bias", "--layer", "ln2", "--position", 2,
                          "--json").stdout)
    cfg = tfmcli.Config(norm_bias=False)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg, fast=False)
    assert_scaled_close(shown["y"], fwd.acts["blocks.0.ln2.out"][0, 2], floor=1e-15)
    assert shown["has_beta"] is False and shown["beta"] == [0.0] * 6
    assert shown["y_model_diff"] < 1e-14 and shown["dx_numeric_diff"] < 1e-8
    said = ok("ln", "--no-norm-bias").stdout
    rows = [line.split()[0] for line in said.splitlines() if line.strip()]
    assert "gamma" in rows and "beta" not in rows   # the table has no beta row
    said = " ".join(said.split())
    assert "sqrt(var + eps) (no beta: --no-norm-bias)" in said and "dbeta" not in said
    with_beta = ok("ln").stdout
    assert "beta" in [line.split()[0] for line in with_beta.splitlines() if line.strip()]
    assert "of dbeta dy" in " ".join(with_beta.split())
    attn = " ".join(ok("attn", "--no-norm-bias", "--qk-norm").stdout.split())
    assert "(Q - mean) / sqrt(var + eps) * q_norm.gamma 0 1 2" in attn   # the table follows
    assert "q_norm.beta" not in attn
    biased = " ".join(ok("attn", "--qk-norm").stdout.split())
    assert "(Q - mean) / sqrt(var + eps) * q_norm.gamma + q_norm.beta 0 1 2" in biased
    trained = json.loads(ok("train", "--steps", 2, "--no-norm-bias", "--json").stdout)
    assert trained["config"]["norm_bias"] is False
    checked = json.loads(ok("check", "--against", "torch", "--no-norm-bias", "--json").stdout)
    assert checked["passed"] is True


def test_the_flag_survives_a_save_load_round_trip(tmp_path):
    path = tmp_path / "run.npz"
    saved = json.loads(ok("forward", "--no-norm-bias", "--save", path, "--json").stdout)
    loaded = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert saved["config"] == loaded["config"] and loaded["config"]["norm_bias"] is False
    assert loaded["loss"] == saved["loss"]


def test_a_file_without_its_config_reads_gamma_alone_as_the_norm_given(tmp_path):
    """Gamma alone is RMSNorm's or a layer norm's without beta; the file cannot tell which, so
    it is RMSNorm unless --no-norm-bias says otherwise, and the two give different losses."""
    path, bare = tmp_path / "run.npz", tmp_path / "bare.npz"
    saved = json.loads(ok("forward", "--no-norm-bias", "--save", path, "--json").stdout)
    with np.load(path) as stored:
        np.savez(bare, **{k: v for k, v in stored.items() if k != "config"})
    as_rms = json.loads(ok("forward", "--load", bare, "--json").stdout)
    assert as_rms["config"]["rms_norm"] is True and as_rms["loss"] != saved["loss"]
    as_plain = json.loads(ok("forward", "--load", bare, "--no-norm-bias", "--json").stdout)
    assert as_plain["config"]["rms_norm"] is False and as_plain["config"]["norm_bias"] is False
    assert as_plain["loss"] == saved["loss"]
