"""A norm of the embedding (``embed_norm``, ``--embed-norm``): BLOOM's
``word_embeddings_layernorm``, ``x0 = LN_embed(W_E[id])``. The parameters, the first block's
input written out by hand, central differences at random O(1) parameters, the fast path, the
torch reference, the KV cache, ``tfm ln --layer ln_embed``, the refusals and the round trip.
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


def norm_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3), pe="alibi",
                embed_norm=True)
    return tfmcli.Config(**{**base, **fields})


def test_the_norm_has_its_parameters_before_the_blocks():
    names = list(param_shapes(norm_cfg()))
    assert names[:4] == ["embed.W_E", "ln_embed.gamma", "ln_embed.beta", "blocks.0.ln1.gamma"]
    rms = list(param_shapes(norm_cfg(rms_norm=True)))
    assert rms[:3] == ["embed.W_E", "ln_embed.gamma", "blocks.0.ln1.gamma"]
    assert "ln_embed.gamma" not in param_shapes(norm_cfg(embed_norm=False))


def test_the_first_block_reads_the_normalised_embedding():
    """blocks.0.in is (W_E[id] - mean) / sqrt(var + eps) * gamma + beta, written out here."""
    cfg = norm_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    for fast in (True, False):
        fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg, fast=fast)
        rows = params["embed.W_E"][fwd.inputs.tokens]
        mean, var = rows.mean(-1, keepdims=True), rows.var(-1, keepdims=True)
        x0 = (rows - mean) / np.sqrt(var + cfg.eps) * params["ln_embed.gamma"] + params[
            "ln_embed.beta"
        ]
        assert_scaled_close(fwd.acts["blocks.0.in"], x0, floor=1e-13)
        assert fwd.acts["ln_embed.out"] is fwd.acts["blocks.0.in"]
        np.testing.assert_array_equal(fwd.acts["embed"], rows)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(rms_norm=True, pe="rope", activation="swiglu"),
    dict(norm="post", pe="none", tied_head=True),
], ids=["alibi-layer-norm", "rope-rms", "post-tied"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(norm_cfg(**fields))
    assert {"ln_embed.gamma"} <= {c.name for c in report.params}


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32", rms_norm=True)],
                         ids=["float64", "float32-rms"])
def test_fast_path_equals_the_reference(fields):
    cfg = norm_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(rms_norm=True, pe="rope", tied_head=True)):
        rows = torch_reference_rows(norm_cfg(**fields), seed=8)
        names = {r.name for r in rows}
        assert "grad ln_embed.gamma" in names
        assert max(r.rel for r in rows if not r.name.endswith("attn.b_K")) < 1e-12


def test_the_kv_cache_decodes_like_the_forward():
    decoded_like_the_forward(norm_cfg(batch=1, seq_len=6, lengths=None), seed=5,
                             tokens=[3, 1, 4, 1, 5, 9])


def test_an_added_encoding_is_refused():
    with pytest.raises(tfmcli.ConfigError, match="allowed pe: none, rope, alibi"):
        norm_cfg(pe="learned")
    line = error_line(run("forward", "--embed-norm"), 2)
    assert "'--embed-norm'" in line and "pe 'sinusoidal' adds to it" in line


# ---------------------------------------------------------------- the command line

FLAGS = ["--pe", "alibi", "--embed-norm"]


def _default_run():
    """The CLI's default run with FLAGS, by the API: its parameters, inputs and config."""
    cfg = tfmcli.Config(pe="alibi", embed_norm=True)
    return tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg


def test_the_flag_reaches_the_run_the_panel_and_the_views():
    data = json.loads(ok("forward", *FLAGS, "--json").stdout)
    assert data["config"]["embed_norm"] is True
    panel = " ".join(ok("forward", *FLAGS).stdout.replace("│", " ").split())
    assert "embed norm layer norm of W_E[id] before block 0 (ln_embed)" in panel
    grads = json.loads(ok("backward", *FLAGS, "--layer", "ln_embed", "--json").stdout)
    assert [g["name"] for g in grads["gradients"]] == ["ln_embed.gamma", "ln_embed.beta"]
    shown = json.loads(ok("ln", *FLAGS, "--layer", "ln_embed", "--position", 2, "--json").stdout)
    # x is the token's embedding row, its y the model's ln_embed.out, dx against central differences
    run_ = tfmcli.forward(*_default_run(), fast=False)
    np.testing.assert_array_equal(shown["x"], run_.acts["embed"][0, 2])
    assert_scaled_close(shown["y"], run_.acts["ln_embed.out"][0, 2], floor=1e-15)
    assert shown["y_model_diff"] < 1e-14 and shown["dx_numeric_diff"] < 1e-8
    line = error_line(run("ln", "--layer", "ln_embed"), 2)
    assert "'--layer'" in line and line.endswith("this model has no ln_embed: add --embed-norm")
    line = error_line(run("ln", *FLAGS, "--layer", "ln_embed", "--block", 0), 2)
    assert line.endswith("ln_embed comes before block 0; it takes no --block")
    # tfm embed's dx0 is the gradient before the norm: its dW_E is central differences' through it
    embedded = json.loads(ok("embed", *FLAGS, "--json").stdout)
    assert embedded["dW_E_numeric_diff"] < 1e-8 and embedded["dW_E_model_diff"] == 0.0
    said = " ".join(ok("embed", *FLAGS).stdout.split())
    assert "which ln_embed normalises into the first block's input" in said
    trained = json.loads(ok("train", "--steps", 2, *FLAGS, "--json").stdout)
    assert trained["config"]["embed_norm"] is True
    checked = json.loads(ok("check", "--against", "torch", *FLAGS, "--json").stdout)
    assert checked["passed"] is True


def test_the_flag_survives_a_save_load_round_trip(tmp_path):
    from tfmcli.sources.npz import _infer_fields

    path = tmp_path / "run.npz"
    saved = json.loads(ok("forward", *FLAGS, "--save", path, "--json").stdout)
    loaded = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert saved["config"] == loaded["config"] and loaded["config"]["embed_norm"] is True
    assert loaded["loss"] == saved["loss"]
    with np.load(path) as stored:
        arrays = dict(stored)
    assert _infer_fields(path, arrays)["embed_norm"] is True
