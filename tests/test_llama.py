"""LLaMA's last two pieces: linear layers without biases (``bias``, ``--no-bias``) and RoPE's
base (``rope_theta``, ``--rope-theta``). The model at random O(1) parameters against central
differences, the torch reference and Hugging Face's LlamaForCausalLM as LLaMA 3 and SmolLM
configure it (no bias, a base of 500000, grouped keys, the head tied or not); the views, the
fast path, the KV cache and a bare ``.npz``.
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
    llama_from,
    llama_grads,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine import positional
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.errors import ConfigError

# LLaMA's block: RMSNorm, RoPE, SwiGLU, grouped keys, no biases anywhere
LLAMA = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False)


def llama_cfg(**fields):
    # d_head 4: two rotation pairs, the second turning at t / rope_theta^(1/2)
    base = dict(d_model=16, heads=4, kv_heads=2, seq_len=5, lengths=(5, 3), d_ff=12, **LLAMA)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- no biases


def test_without_biases_the_linear_layers_have_weights_only():
    shapes = param_shapes(llama_cfg())
    assert not [name for name in shapes if ".b_" in name]
    assert [name for name in shapes if name.startswith("blocks.0.")] == [
        "blocks.0.ln1.gamma", "blocks.0.attn.W_Q", "blocks.0.attn.W_K", "blocks.0.attn.W_V",
        "blocks.0.attn.W_O", "blocks.0.ln2.gamma", "blocks.0.ffn.W_gate", "blocks.0.ffn.W_1",
        "blocks.0.ffn.W_2"]
    # the biases dropped: b_Q, b_O 16 each, b_K, b_V 8 each, b_gate, b_1 12 each, b_2 16
    assert param_count(llama_cfg(bias=True)) - param_count(llama_cfg()) == 16 * 3 + 8 * 2 + 12 * 2


def test_smollm_135m_has_its_parameter_count():
    """HuggingFaceTB/SmolLM-135M's sizes (its config.json): 134,515,008 parameters, the tied
    embedding counted once."""
    cfg = tfmcli.Config(d_model=576, heads=9, kv_heads=3, layers=30, d_ff=1536, vocab=49152,
                        tied_head=True, **LLAMA)
    assert param_count(cfg) == 134_515_008
    assert "134,515,008" in ok("shapes", "-d", 576, "-H", 9, "--kv-heads", 3, "-L", 30,
                               "--d-ff", 1536, "-V", 49152, "--tied-head", "--no-head-bias",
                               "--no-bias", "--pe", "rope", "--activation", "swiglu",
                               "--rms-norm").stdout


def test_no_biases_draw_the_same_weights():
    """Biases are never drawn (they start at 0), so the weights of a model without them are
    the same numbers, and at those initial zeros its loss is the same as with them."""
    cfg = llama_cfg(bias=True)
    with_b, without = tfmcli.init_params(cfg), tfmcli.init_params(cfg.replace(bias=False))
    assert all(np.array_equal(without[name], with_b[name]) for name in without)
    inputs = tfmcli.make_inputs(cfg)
    assert (tfmcli.forward(with_b, inputs, cfg).loss
            == tfmcli.forward(without, inputs, cfg.replace(bias=False)).loss)


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2, kv_heads=None),
                                    dict(pe="sinusoidal", activation="gelu", rms_norm=False,
                                         tied_head=True, head_bias=True),
                                    dict(rope_theta=3.0, causal=False)],
                         ids=["llama", "post-L2", "gelu-layernorm-tied", "theta3-bidirectional"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(llama_cfg(**fields))
    assert not [c.name for c in report.params if ".b_" in c.name and "b_U" not in c.name]


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", rope_theta=50.0), dict(dtype="float32")):
        rows = torch_reference_rows(llama_cfg(**fields), seed=9)
        assert not any(".b_" in r.name for r in rows)
        assert any(r.name == "grad blocks.0.ffn.W_gate" for r in rows)


def test_fast_path_equals_the_reference():
    cfg = llama_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), d_model=24, heads=6, layers=2,
                    rope_theta=500000.0)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_hugging_face_llama_as_llama_3_configures_it(tied):
    """LlamaForCausalLM with no biases (attention_bias and mlp_bias false), rope_theta 500000,
    2 key/value heads of 4, and the head untied (LLaMA 3 8B) or tied (SmolLM, LLaMA 3.2 1B):
    loss, logits and every parameter's gradient, at random parameters, padding included."""
    pytest.importorskip("torch")
    cfg = llama_cfg(layers=2, rope_theta=500000.0, tied_head=tied)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = llama_from(params, cfg)
    assert model.model.layers[0].self_attn.q_proj.bias is None
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params) == set(grads)
    assert_grads_match(grads, theirs)


def test_kv_cache_equals_the_full_forward_without_biases():
    cfg = llama_cfg(batch=1, seq_len=6, lengths=None, layers=2, rope_theta=77.0)
    decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2])


def test_a_bare_npz_without_biases_loads_as_such(tmp_path):
    cfg = llama_cfg(pe="sinusoidal", lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    path = tmp_path / "bare.npz"
    np.savez(path, **{f"param/{name}": value for name, value in params.items()})
    out = json.loads(ok("forward", "--load", path, "-H", 4, "--kv-heads", 2, "-T", 5,
                        "--activation", "swiglu", "--json").stdout)
    assert out["config"]["bias"] is False and out["config"]["rms_norm"] is True
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg.replace(seed=out["config"]["seed"])), cfg)
    assert out["loss"] == pytest.approx(fwd.loss, rel=1e-12)


# ---------------------------------------------------------------- RoPE's base


def test_rope_theta_sets_each_pairs_frequency():
    angles = positional.rope_angles(3, 8, base=500000.0)                # (T, 4 pairs)
    assert_scaled_close(angles[2], 2 / 500000.0 ** (np.arange(4) * 2 / 8))
    np.testing.assert_array_equal(positional.rope_angles(5, 6), positional.rope_angles(5, 6, 1e4))
    slow, fast = llama_cfg(rope_theta=500000.0), llama_cfg(rope_theta=10.0)
    params, inputs = tfmcli.init_params(slow), tfmcli.make_inputs(slow)
    assert tfmcli.forward(params, inputs, slow).loss != tfmcli.forward(params, inputs, fast).loss


@pytest.mark.parametrize("theta", [0, -1.0, float("nan"), float("inf"), True, "big"])
def test_rope_theta_must_be_a_positive_finite_number(theta):
    with pytest.raises(ConfigError, match="rope_theta must be a positive finite number"):
        llama_cfg(rope_theta=theta)


def test_rope_theta_on_the_command_line():
    assert error_line(run("forward", "--rope-theta", 500000), 2) == (
        "tfm forward: error: Invalid value for '--rope-theta': it sets RoPE's base, and this "
        "model's --pe is sinusoidal; add --pe rope")
    assert "rope_theta must be a positive finite number, got -5.0" in error_line(
        run("forward", "--pe", "rope", "--rope-theta", -5), 2)
    assert error_line(run("pe", "--rope-theta", 5), 2).endswith("it sets RoPE's base; add --rope")
    assert "(allowed: a finite number > 0)" in error_line(run("pe", "--rope", "--rope-theta", 0), 2)
    panel = ok("forward", "--pe", "rope", "--rope-theta", 500000).stdout
    assert "rope (theta 500000)" in panel


def test_tfm_pe_rope_theta_slows_the_last_pair():
    """Pair (3,7) of an 8-wide head turns once every 2 pi theta^(6/8) positions: 6,283 at
    10000, 118,000 at 500000 (LLaMA 3's)."""
    default = json.loads(ok("pe", "--rope", "-d", 8, "--len", 4, "--json").stdout)
    slow = json.loads(ok("pe", "--rope", "-d", 8, "--len", 4, "--rope-theta", 500000,
                         "--json").stdout)
    assert slow["angles"][1][3] == pytest.approx(1 / 500000 ** 0.75, rel=1e-15)
    assert default["angles"][1][3] == pytest.approx(1 / 10000 ** 0.75, rel=1e-15)
    text = ok("pe", "--rope", "-d", 8, "--len", 4, "--rope-theta", 500000).stdout
    assert "once every 1.18e+05" in text and "turns by t / 500000^(2i/8)" in text


# ---------------------------------------------------------------- the views


def test_views_leave_out_the_biases_the_model_does_not_have():
    flags = ["-d", 8, "-H", 4, "--kv-heads", 2, "--pe", "rope", "--activation", "swiglu",
             "--rms-norm", "--no-bias", "--no-head-bias"]
    attn = ok("attn", *flags).stdout
    assert "Q = X W_Q" in attn and "b_Q" not in attn and "b_K" not in attn
    ffn = ok("ffn", *flags).stdout
    assert "out = (silu(x W_gate) * (x W_1)) W_2" in ffn and "b_1" not in ffn
    assert "of dW_1 x^T dpre; of dW_2 hidden^T dout" in ffn.replace("\n", " ")
    assert "none in attention and FFN" in ok("forward", *flags).stdout
    names = [g["name"] for g in json.loads(ok("backward", *flags, "--json").stdout)["gradients"]]
    assert "blocks.0.ffn.W_gate" in names and [n for n in names if ".b_" in n] == []
