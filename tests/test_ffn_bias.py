"""Biases on the FFN alone (``ffn_bias``, ``--no-bias --ffn-bias``): GPT-J's linear layers, whose
attention adds none and whose MLP adds ``b_1`` and ``b_2``. The parameters, the FFN written out
by hand, central differences at random O(1) parameters, the fast path, the torch reference,
``tfm ffn``'s formulas, the panel, the refusals and the round trip.
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
    error_line,
    ok,
    random_params,
    run,
    torch_reference_rows,
)
from tfmcli.engine.sizes import param_shapes

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def ffn_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3),
                bias=False, ffn_bias=True)
    return tfmcli.Config(**{**base, **fields})


@pytest.mark.parametrize("fields, ffn", [
    (dict(), ["ffn.b_1", "ffn.b_2"]),
    (dict(activation="swiglu"), ["ffn.b_gate", "ffn.b_1", "ffn.b_2"]),
    (dict(qkv_bias=True), ["ffn.b_1", "ffn.b_2"]),
], ids=["relu", "swiglu", "with-qkv"])
def test_the_ffn_has_its_biases_and_attention_none(fields, ffn):
    cfg = ffn_cfg(**fields)
    shapes = param_shapes(cfg)
    biases = [n.split(".", 2)[2] for n in shapes if n.startswith("blocks.0.") and ".b_" in n]
    attn = ["attn.b_Q", "attn.b_K", "attn.b_V"] if cfg.qkv_bias else []
    assert biases == attn + ffn
    assert shapes["blocks.1.ffn.b_1"] == (cfg.ff,) and shapes["blocks.1.ffn.b_2"] == (8,)
    assert "head.b_U" in shapes   # the head's is head_bias's
    # with --bias every layer has one already, and ffn_bias adds none
    assert param_shapes(ffn_cfg(bias=True)) == param_shapes(ffn_cfg(bias=True, ffn_bias=False))


def test_the_ffn_adds_its_biases():
    """ffn.out is relu(x W_1 + b_1) W_2 + b_2 on the run's ln2.out, written out here; attention's
    output is context W_O with no b_O."""
    cfg = ffn_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg, fast=False)
    P, p = params, "blocks.1."
    h = fwd.acts[p + "ln2.out"]
    ffn = (np.maximum(h @ P[p + "ffn.W_1"] + P[p + "ffn.b_1"], 0) @ P[p + "ffn.W_2"]
           + P[p + "ffn.b_2"])
    assert_scaled_close(fwd.acts[p + "ffn.out"], ffn, floor=1e-13)
    context = fwd.acts[p + "attn.context"]
    assert_scaled_close(fwd.acts[p + "attn.out"], context @ P[p + "attn.W_O"], floor=1e-13)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(activation="swiglu", rms_norm=True, pe="rope"),
    dict(parallel_residual=True, shared_norm=True, pe="rope", rotary_dim=2, activation="gelu"),
    dict(norm="post", qkv_bias=True, activation="geglu"),
], ids=["relu", "swiglu-rms-rope", "gpt-j-like", "post-qkv-geglu"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(ffn_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32", activation="swiglu")],
                         ids=["float64", "float32-swiglu"])
def test_fast_path_equals_the_reference(fields):
    cfg = ffn_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(parallel_residual=True, shared_norm=True, activation="gelu",
                                pe="rope", rotary_dim=2)):
        rows = torch_reference_rows(ffn_cfg(**fields), seed=8)
        assert [r.name for r in rows if ".b_" in r.name] == [
            f"grad blocks.{i}.ffn.b_{w}" for i in (0, 1) for w in (1, 2)] + ["grad head.b_U"]
        assert max(r.rel for r in rows) < 1e-12


# ---------------------------------------------------------------- the command line

FLAGS = ["-d", 8, "-H", 2, "--no-bias", "--ffn-bias"]


def test_the_flag_reaches_the_run_the_panel_the_views_and_train():
    data = json.loads(ok("forward", *FLAGS, "--json").stdout)
    assert data["config"]["ffn_bias"] is True and data["config"]["bias"] is False
    panel = " ".join(ok("forward", *FLAGS).stdout.replace("│", " ").split())
    assert "biases FFN only (b_1, b_2)" in panel
    gated = " ".join(ok("forward", *FLAGS, "--activation", "swiglu", "--qkv-bias").stdout
                     .replace("│", " ").split())
    assert "biases Q, K, V and FFN only (b_Q, b_K, b_V, b_gate, b_1, b_2)" in gated
    shown = " ".join(ok("ffn", *FLAGS, "-t", 2).stdout.split())
    assert "out = relu(x W_1 + b_1) W_2 + b_2" in shown and "of db_1 dpre" in shown
    bare = " ".join(ok("ffn", "-d", 8, "-H", 2, "--no-bias", "-t", 2).stdout.split())
    assert "out = relu(x W_1) W_2" in bare and "db_1" not in bare
    grads = json.loads(ok("backward", *FLAGS, "--json").stdout)
    names = {g["name"] for g in grads["gradients"]}
    assert {"blocks.0.ffn.b_1", "blocks.0.ffn.b_2"} <= names
    assert not {"blocks.0.attn.b_Q", "blocks.0.attn.b_O"} & names
    trained = json.loads(ok("train", "--steps", 2, "--no-bias", "--ffn-bias", "--json").stdout)
    assert trained["config"]["ffn_bias"] is True
    checked = json.loads(ok("check", "--against", "torch", *FLAGS, "--json").stdout)
    assert checked["passed"] is True


def test_the_flag_survives_a_save_load_round_trip(tmp_path):
    """Saved with --no-bias --ffn-bias, the file holds the FFN's biases alone and reloads to
    the same config and loss; without its config key the arrays say so too."""
    from tfmcli.sources.npz import _infer_fields

    path = tmp_path / "run.npz"
    saved = json.loads(ok("forward", *FLAGS, "--save", path, "--json").stdout)
    loaded = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert saved["config"] == loaded["config"] and loaded["config"]["ffn_bias"] is True
    assert loaded["loss"] == saved["loss"]
    with np.load(path) as stored:
        arrays = dict(stored)
    assert [n for n in arrays if n.startswith("param/blocks.0.") and ".b_" in n] == [
        "param/blocks.0.ffn.b_1", "param/blocks.0.ffn.b_2"]
    inferred = _infer_fields(path, arrays)
    assert (inferred["bias"], inferred["ffn_bias"], inferred["qkv_bias"]) == (False, True, False)


def test_the_flag_with_every_layers_biases_is_refused():
    line = error_line(run("forward", "--ffn-bias"), 2)
    assert "'--ffn-bias'" in line and line.endswith(
        "it gives the FFN's layers biases in a model whose --bias gives every layer one; add "
        "--no-bias")
