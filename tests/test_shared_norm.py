"""A parallel block with one norm (``shared_norm``, ``--shared-norm``): attention and the FFN both
read LN1's output, ``z = x + MHA(LN1(x)) + FFN(LN1(x))`` (Phi-2's and GPT-J's block), and there
is no ln2. Against the block written out by hand, central differences at random O(1)
parameters, the fast path, the torch reference, the KV cache; ``tfm block``'s sums and paths,
``tfm ffn``'s input and ``tfm ln``'s refusal; the Config's refusal.
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
from tfmcli.engine.sizes import activation_shapes, param_shapes
from tfmcli.explain import block, feedforward, layernorm

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def shared_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3),
                parallel_residual=True, shared_norm=True)
    return tfmcli.Config(**{**base, **fields})


def test_both_sublayers_read_ln1s_output_and_there_is_no_ln2():
    """The block's output is x + attention's output + FFN(LN1(x)), the FFN written out here
    (ReLU, biases) on the run's ln1.out; the model has no ln2 parameters nor ln2.out."""
    cfg = shared_cfg()
    assert not [n for n in param_shapes(cfg) if ".ln2." in n]
    assert not [n for n in activation_shapes(cfg) if ".ln2." in n]
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg, fast=False)
    assert list(fwd.acts) == list(activation_shapes(cfg))
    P, p = params, "blocks.1."
    h = fwd.acts[p + "ln1.out"]
    ffn = (np.maximum(h @ P[p + "ffn.W_1"] + P[p + "ffn.b_1"], 0) @ P[p + "ffn.W_2"]
           + P[p + "ffn.b_2"])
    assert_scaled_close(fwd.acts[p + "ffn.out"], ffn, floor=1e-13)
    np.testing.assert_array_equal(fwd.acts[p + "resid1"],
                                  fwd.acts[p + "in"] + fwd.acts[p + "attn.out"])
    assert_scaled_close(fwd.acts[p + "out"], fwd.acts[p + "resid1"] + ffn, floor=1e-13)


def test_one_shared_norm_is_two_norms_with_the_same_weights_and_their_gradients_summed():
    """Pythia's block (two norms) with ln2's weights a copy of ln1's computes the same loss;
    the shared ln1's gradient is the two norms' gradients summed, every other gradient the
    same."""
    cfg = shared_cfg(pe="rope", rotary_dim=2, activation="gelu")
    params = random_params(tfmcli.init_params(cfg), seed=5)
    inputs = tfmcli.inputs_from_tokens(TOKENS)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    two = cfg.replace(shared_norm=False)
    copied = {**params, **{f"blocks.{i}.ln2.{w}": params[f"blocks.{i}.ln1.{w}"]
                           for i in range(2) for w in ("gamma", "beta")}}
    fwd2 = tfmcli.forward(copied, inputs, two)
    assert abs(fwd2.loss - fwd.loss) < 1e-14
    grads2 = tfmcli.backward(copied, fwd2, two)
    for name, grad in grads.items():
        want = grads2[name]
        if ".ln1." in name:
            want = want + grads2[name.replace(".ln1.", ".ln2.")]
        assert_scaled_close(grad, want, floor=1e-13)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(pe="rope", rotary_dim=2, activation="gelu", kv_heads=1),
    dict(rms_norm=True, activation="swiglu", bias=False, head_bias=False, tied_head=True),
    dict(pe="rope", qk_norm=True, activation="gelu_erf", sliding_window=2, sliding_layers=(1,)),
], ids=["layer-norm-relu", "partial-rope-gelu-mqa", "rms-swiglu-tied", "qk-norm-gelu-erf-window"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(shared_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32"),
                                    dict(pe="rope", kv_heads=1, activation="gelu_erf")],
                         ids=["float64", "float32", "rope-mqa-gelu-erf"])
def test_fast_path_equals_the_reference(fields):
    cfg = shared_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(pe="rope", rotary_dim=2, activation="gelu", kv_heads=1)):
        rows = torch_reference_rows(shared_cfg(**fields), seed=8)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_kv_cache_feeds_ln1s_output_to_both_sublayers():
    cfg = shared_cfg(batch=1, lengths=None, seq_len=8, pe="rope", kv_heads=1)
    decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2, 6, 5])


def test_block_explains_each_sum_and_path():
    """``tfm block``'s rows: y and z the run's sums, dy the run's dz, dh the run's gradient at
    ln1's output and the sum of both sublayers' input gradients, dx dz + LN1's backward of dh
    and central differences'; the FFN reads ln1.out (``tfm ffn``); the norms are ln1 and
    ln_f only (``tfm ln``)."""
    cfg = shared_cfg(pe="rope", activation="swiglu")
    params = random_params(tfmcli.init_params(cfg), seed=4)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    g = grads.acts
    assert layernorm.names(cfg) == ["blocks.0.ln1", "blocks.1.ln1", "ln_f"]
    for i in range(2):
        p = f"blocks.{i}."
        assert feedforward.input_name(cfg, i) == p + "ln1.out"
        for b, t in ((0, 0), (0, 4), (1, 2)):
            x = block.explain(params, fwd, grads, cfg, i, b, t)
            f = {r.name: r.value for r in x.forward}
            d = {r.name: r.value for r in x.backward}
            for r in x.forward:
                if r.model is not None:
                    np.testing.assert_allclose(r.value, fwd.acts[p + r.model][b, t], atol=1e-14)
            for r in x.backward:
                if r.model is not None:
                    np.testing.assert_allclose(r.value, g[p + r.model][b, t], atol=1e-14)
            assert [r.model for r in x.backward if r.model] == ["resid1", "ln1.out", "in"]
            np.testing.assert_array_equal(f["z"], f["x"] + f["attn"] + f["ffn"])
            np.testing.assert_array_equal(d["dy"], g[p + "out"][b, t])
            np.testing.assert_allclose(d["dh"], d["dattn in"] + d["dffn in"], atol=1e-15)
            np.testing.assert_allclose(d["norm path"], g[p + "in"][b, t] - g[p + "out"][b, t],
                                       atol=1e-14)
            np.testing.assert_allclose(x.numeric_dx, d["dx"], atol=1e-8)


# ---------------------------------------------------------------- the command line

FLAGS = ["-d", 8, "-H", 2, "-L", 2, "--parallel-residual", "--shared-norm"]


def test_the_flag_reaches_the_run_the_panel_the_views_and_train():
    data = json.loads(ok("forward", *FLAGS, "--json").stdout)
    assert data["config"]["shared_norm"] is True
    assert "blocks.0.ln2.out" not in {a["name"] for a in data["activations"]}
    panel = " ".join(ok("forward", *FLAGS).stdout.replace("│", " ").split())
    assert "Pre-LN (+ final ln_f), parallel, one norm (both read LN1(x))" in panel
    shown = " ".join(ok("block", *FLAGS, "--block", 1).stdout.split())
    assert "Pre-LN, parallel, one norm: h = LN1(x), z = x + MHA(h) + FFN(h)" in shown
    assert "dattn in + dffn in: both read h = LN1(x)" in shown
    ffn = json.loads(ok("ffn", *FLAGS, "-t", 2, "--json").stdout)
    assert ffn["input"] == "blocks.0.ln1.out" and ffn["dx_numeric_diff"] < 1e-8
    ln1 = json.loads(ok("ln", *FLAGS, "--layer", "ln1", "-t", 2, "--json").stdout)
    assert ln1["y_model_diff"] < 1e-15 and ln1["dx_numeric_diff"] < 1e-8
    trained = json.loads(ok("train", "--steps", 2, "--parallel-residual", "--shared-norm",
                            "--json").stdout)
    assert trained["config"]["shared_norm"] is True
    checked = json.loads(ok("check", "--against", "torch", *FLAGS, "--json").stdout)
    assert checked["passed"] is True


def test_the_flag_survives_a_save_load_round_trip(tmp_path):
    """Saved with --shared-norm, the file holds no ln2 and reloads to the same config and loss
    (at initial weights one norm and two compute the same loss: the file's arrays tell)."""
    path = tmp_path / "run.npz"
    saved = json.loads(ok("forward", *FLAGS, "--save", path, "--json").stdout)
    loaded = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert saved["config"] == loaded["config"] and loaded["config"]["shared_norm"] is True
    assert loaded["loss"] == saved["loss"]
    with np.load(path) as stored:
        assert "param/blocks.0.ln1.gamma" in stored.files
        assert not [name for name in stored.files if ".ln2." in name]


def test_the_views_refuse_ln2_which_the_block_does_not_have():
    line = error_line(run("ln", *FLAGS, "--layer", "ln2"), 2)
    assert "'--layer'" in line and line.endswith(
        "this model has no ln2: its one norm a block, ln1, feeds attention and the FFN "
        "(--shared-norm); use --layer ln1")
    line = error_line(run("backward", *FLAGS, "--layer", "ln2"), 2)
    assert "'--layer'" in line and "no parameter of layer 'ln2'" in line


def test_a_shared_norm_needs_a_parallel_block():
    line = error_line(run("forward", "--shared-norm"), 2)
    assert "'--shared-norm'" in line and line.endswith(
        "a shared norm feeds attention and the FFN side by side, so the block must be parallel "
        "(parallel_residual)")
