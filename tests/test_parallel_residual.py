"""The parallel block (``parallel_residual``, ``--parallel-residual``): attention and the FFN
both read the block's input x, each through its own norm, ``z = x + MHA(LN1(x)) +
FFN(LN2(x))`` (GPT-NeoX's and Pythia's ``use_parallel_residual``). Against the block written
out by hand, central differences at random O(1) parameters, the fast path, the torch reference,
Hugging Face's GPT-NeoX with its own parallel residual, the KV cache; ``tfm block``'s sums and
paths; the refusals.
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
    error_line,
    neox_from,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.explain import block, layernorm

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def parallel_cfg(**fields):
    base = dict(d_model=8, heads=2, layers=2, vocab=11, seq_len=5, lengths=(5, 3),
                parallel_residual=True)
    return tfmcli.Config(**{**base, **fields})


def test_each_sublayer_reads_the_blocks_input():
    """The block's output is y + FFN(LN2(x)), with the FFN and its layer norm written out here
    (ReLU, biases, the biased variance), and y = x + attention's output; the sequential block
    (LN2 reading y) gives other numbers."""
    cfg = parallel_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg, fast=False)
    P, p = params, "blocks.1."
    x = fwd.acts[p + "in"]
    centred = x - x.mean(-1, keepdims=True)
    h = (centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + cfg.eps)
         * P[p + "ln2.gamma"] + P[p + "ln2.beta"])
    ffn = (np.maximum(h @ P[p + "ffn.W_1"] + P[p + "ffn.b_1"], 0) @ P[p + "ffn.W_2"]
           + P[p + "ffn.b_2"])
    assert_scaled_close(fwd.acts[p + "ln2.out"], h, floor=1e-13)
    np.testing.assert_allclose(fwd.acts[p + "resid1"], x + fwd.acts[p + "attn.out"], atol=0)
    assert_scaled_close(fwd.acts[p + "out"], fwd.acts[p + "resid1"] + ffn, floor=1e-13)
    sequential = tfmcli.forward(params, fwd.inputs, cfg.replace(parallel_residual=False))
    assert np.abs(sequential.acts["blocks.0.out"] - fwd.acts["blocks.0.out"]).max() > 1e-2
    np.testing.assert_array_equal(sequential.acts["blocks.0.resid1"],
                                  fwd.acts["blocks.0.resid1"])   # attention's half is the same


@pytest.mark.parametrize("fields", [
    dict(),
    dict(rms_norm=True, activation="swiglu", kv_heads=1, bias=False, head_bias=False),
    dict(pe="rope", rotary_dim=2, activation="gelu", qk_norm=True, tied_head=True),
    dict(pe="rope", sliding_window=2, sliding_layers=(1,), qkv_bias=True, bias=False,
         activation="geglu"),
], ids=["layer-norm-relu", "rms-swiglu-mqa", "partial-rope-gelu-qk-norm", "window-geglu"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(parallel_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32"),
                                    dict(pe="rope", kv_heads=1, activation="swiglu")],
                         ids=["float64", "float32", "rope-mqa-swiglu"])
def test_fast_path_equals_the_reference(fields):
    cfg = parallel_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), d_model=16, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(pe="rope", rms_norm=True, activation="swiglu", kv_heads=1)):
        rows = torch_reference_rows(parallel_cfg(**fields), seed=8)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_matches_hugging_face_gpt_neox_with_its_parallel_residual():
    """GPT-NeoX with ``use_parallel_residual`` (Pythia's block): loss, logits and the
    gradients of every norm, the MLP and the embedding to 1e-12, padding included."""
    pytest.importorskip("torch")
    cfg = parallel_cfg(d_model=16, heads=2, head_bias=False, pe="rope", rotary_dim=4,
                       activation="gelu", seq_len=7, lengths=(7, 4))
    params = random_params(tfmcli.init_params(cfg), seed=9)
    neox = neox_from(params, cfg, 4, parallel=True)
    grads = tfm_grads_matching_hf(neox, params, tfmcli.make_inputs(cfg), cfg)
    theirs = {}
    for i, layer in enumerate(neox.gpt_neox.layers):
        p = f"blocks.{i}."
        for ours, param in ((p + "ln1.gamma", layer.input_layernorm.weight),
                            (p + "ln2.beta", layer.post_attention_layernorm.bias),
                            (p + "ffn.W_1", layer.mlp.dense_h_to_4h.weight),
                            (p + "ffn.b_2", layer.mlp.dense_4h_to_h.bias),
                            (p + "attn.W_O", layer.attention.dense.weight)):
            grad = param.grad.numpy()
            theirs[ours] = grad.T if grad.ndim == 2 else grad
    theirs["embed.W_E"] = neox.gpt_neox.embed_in.weight.grad.numpy()
    assert_grads_match(grads, theirs)


def test_kv_cache_reads_the_same_input_for_both_sublayers():
    cfg = parallel_cfg(batch=1, lengths=None, seq_len=8, pe="rope", kv_heads=1)
    params, steps, _ = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2, 6, 5])
    sequential = tfmcli.engine.kv.decode(params, [3, 1, 4, 1, 5, 2, 6, 5],
                                  cfg.replace(parallel_residual=False))
    assert np.abs(sequential[-1].logits - steps[-1].logits).max() > 1e-3


def test_block_explains_each_sum_and_path():
    """``tfm block``'s rows: y and z the run's sums, dy the run's dz, dx the run's gradient at
    the input and dz + both paths, each path the difference it stands for, dx by central
    differences; ln2 reads the block's input (``tfm ln``)."""
    cfg = parallel_cfg(pe="rope", activation="swiglu")
    params = random_params(tfmcli.init_params(cfg), seed=4)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    g = grads.acts
    for i in range(2):
        p = f"blocks.{i}."
        assert layernorm.input_name(cfg, p + "ln2") == p + "in"
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
            assert [r.model for r in x.backward if r.model] == [
                "ln2.out", "resid1", "ln1.out", "in"]
            np.testing.assert_array_equal(f["z"], f["x"] + f["attn"] + f["ffn"])
            np.testing.assert_array_equal(d["dy"], g[p + "out"][b, t])
            np.testing.assert_allclose(d["ffn path"] + d["attn path"],
                                       g[p + "in"][b, t] - g[p + "out"][b, t], atol=1e-14)
            np.testing.assert_allclose(x.numeric_dx, d["dx"], atol=1e-8)


# ---------------------------------------------------------------- the command line

FLAGS = ["-d", 8, "-H", 2, "-L", 2, "--parallel-residual"]


def test_the_flag_reaches_the_run_the_panel_and_train():
    data = json.loads(ok("forward", *FLAGS, "--json").stdout)
    assert data["config"]["parallel_residual"] is True
    panel = " ".join(ok("forward", *FLAGS).stdout.replace("│", " ").split())
    assert "Pre-LN (+ final ln_f), parallel (both sublayers read x)" in panel
    shown = " ".join(ok("block", *FLAGS, "--block", 1).stdout.split())
    assert "Pre-LN, parallel: y = x + MHA(LN1(x)), z = y + FFN(LN2(x))" in shown
    assert "dz carried straight through (the FFN reads x, not y)" in shown
    ln2 = json.loads(ok("ln", *FLAGS, "--layer", "ln2", "-t", 2, "--json").stdout)
    cfg = parallel_cfg(lengths=None, seq_len=4, vocab=8)   # the command's, with FLAGS
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    np.testing.assert_array_equal(ln2["x"], fwd.acts["blocks.0.in"][0, 2])   # LN2 reads x
    assert ln2["y_model_diff"] < 1e-15 and ln2["dx_numeric_diff"] < 1e-8
    trained = json.loads(ok("train", "--steps", 2, "--parallel-residual", "--json").stdout)
    assert trained["config"]["parallel_residual"] is True
    checked = json.loads(ok("check", "--against", "torch", *FLAGS, "--json").stdout)
    assert checked["passed"] is True


@pytest.mark.parametrize("args", [["--norm", "post"], ["--sandwich-norm"]],
                         ids=["post-ln", "sandwich"])
def test_a_parallel_block_needs_pre_ln_without_a_sandwich(args):
    line = error_line(run("forward", "--parallel-residual", *args), 2)
    assert "'--parallel-residual'" in line and line.endswith(
        "so the norms must be Pre-LN (norm 'pre') without sandwich_norm")
