"""RoPE on part of each head (``rotary_dim``, ``--rotary-dim``: Hugging Face's
``partial_rotary_factor`` times d_head, GPT-NeoX's ``rotary_pct``): the first ``rotary_dim``
dimensions of each query and key turn, paired ``(i, i + rotary_dim / 2)`` at angles over
``rotary_dim``, and the rest pass. The rotation by hand; the model at random O(1) parameters
against central differences, the fast path, the torch reference, GPT-NeoX and the KV cache; a
Phi-3 folder with ``partial_rotary_factor`` against Phi3ForCausalLM; the flags and views.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_folder_matches_hf,
    assert_gradcheck_passes,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    hf_saved,
    neox_from,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine import ops, positional
from tfmcli.engine.sizes import memory_estimate


def partial_cfg(**fields):
    """Heads of 6, the first 2 dimensions of each turned: pair (0, 1) at angle t."""
    base = dict(d_model=12, heads=2, seq_len=6, lengths=(6, 4), pe="rope", rotary_dim=2,
                activation="gelu")
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the rotation


def test_the_first_dimensions_turn_and_the_rest_pass():
    """By hand: with rotary_dim 2 the one pair is (0, 1), at angle t / base^0 = t; dimensions
    2..5 come out as they went in, bit for bit."""
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 6))
    cos, sin = positional.rope_tables(5, 2)
    assert cos.shape == (5, 2)
    out = ops.rope_forward(x, cos, sin)
    t = np.arange(5.0)
    assert_scaled_close(out[..., 0], x[..., 0] * np.cos(t) - x[..., 1] * np.sin(t), floor=1e-15)
    assert_scaled_close(out[..., 1], x[..., 1] * np.cos(t) + x[..., 0] * np.sin(t), floor=1e-15)
    np.testing.assert_array_equal(out[..., 2:], x[..., 2:])
    # four of six turn as pairs (0, 2) and (1, 3), at angles over four dimensions
    cos, sin = positional.rope_tables(5, 4, base=100.0)
    out = ops.rope_forward(x, cos, sin)
    slow = t / 100.0 ** (2 / 4)
    assert_scaled_close(out[..., 1],
                        x[..., 1] * np.cos(slow) - x[..., 3] * np.sin(slow), floor=1e-15)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])


def test_rotate_half_of_a_slice_with_gaps():
    """A one-pair slice of a wider head (rotary_dim 2 of 8): its quarter turn is (-x1, x0).
    NumPy 2.4.6's np.negative(..., out=) got this wrong in float64 (it read x's neighbours)."""
    x = np.arange(24.0).reshape(1, 3, 8)
    turned = ops.rotate_half(x[..., :2])
    np.testing.assert_array_equal(turned[..., 0], -x[..., 1])
    np.testing.assert_array_equal(turned[..., 1], x[..., 0])


def test_the_backward_is_the_transpose():
    """<R x, g> = <x, R^T g>; the passed dimensions' gradient is the upstream one."""
    rng = np.random.default_rng(1)
    x, g = rng.normal(size=(2, 2, 7, 8)), rng.normal(size=(2, 2, 7, 8))
    cos, sin = positional.rope_tables(7, 4, base=30.0)
    back = ops.rope_backward(g, cos, sin)
    assert np.vdot(ops.rope_forward(x, cos, sin), g) == pytest.approx(np.vdot(x, back),
                                                                       rel=1e-13)
    np.testing.assert_array_equal(back[..., 4:], g[..., 4:])


def test_the_whole_head_is_the_same_bits_as_no_rotary_dim():
    cfg = partial_cfg(rotary_dim=None)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    inputs = tfmcli.make_inputs(cfg)
    whole = tfmcli.forward(params, inputs, cfg.replace(rotary_dim=6))
    plain = tfmcli.forward(params, inputs, cfg)
    for name, value in plain.acts.items():
        np.testing.assert_array_equal(whole.acts[name], value, err_msg=name)


def test_a_partial_rotation_changes_the_numbers_and_keeps_the_rest_of_q():
    cfg = partial_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    q, q_rot = fwd.acts["blocks.0.attn.q"], fwd.acts["blocks.0.attn.q_rot"]
    np.testing.assert_array_equal(q_rot[..., 2:], q[..., 2:])
    assert np.abs(q_rot[..., :2] - q[..., :2]).max() > 0.1
    whole = tfmcli.forward(params, fwd.inputs, cfg.replace(rotary_dim=None))
    assert abs(whole.loss - fwd.loss) > 1e-4


@pytest.mark.parametrize("fields, reason", [
    (dict(rotary_dim=3), "rotary_dim=3 is not an even width within a head of 6 (RoPE turns "
                         "pairs of its dimensions); allowed: 2, 4, 6"),
    (dict(rotary_dim=8), "allowed: 2, 4, 6"),
    (dict(rotary_dim=0), "rotary_dim must be a positive integer, got 0"),
    (dict(pe="sinusoidal"), "rotary_dim is how many of a head's dimensions RoPE turns, and pe "
                            "is 'sinusoidal', not 'rope'"),
    (dict(head_dim=1), "allowed: none"),
    (dict(head_dim=40), "allowed: 2, 4, ..., 40"),
    (dict(head_dim=40, rotary_dim=41), "allowed: 2, 4, ..., 40"),
])
def test_the_config_refuses_what_rope_cannot_turn(fields, reason):
    if fields.get("head_dim") in (1, 40) and "rotary_dim" not in fields:
        fields["rotary_dim"] = 3
    with pytest.raises(tfmcli.ConfigError) as raised:
        partial_cfg(**fields)
    assert raised.value.field == "rotary_dim" and reason in str(raised.value)


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [
    dict(),
    dict(rotary_dim=4, rms_norm=True, kv_heads=1, qk_norm=True, bias=False, head_bias=False,
         activation="swiglu", layers=2),
    dict(head_dim=5, rotary_dim=2, rope_scaling=3.0, norm="post"),
    dict(layers=2, sliding_window=3, sliding_layers=(0,), rope_local_theta=5.0,
         rope_scaling=(2.5, 0.5, 3.0, 30)),
], ids=["two-of-six", "four-of-six-qk-norm-mqa", "two-of-odd-five-linear", "local-base-llama3"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(partial_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32"),
                                    dict(rotary_dim=4, kv_heads=1, qk_norm=True,
                                         sliding_window=100)],
                         ids=["float64", "float32", "four-grouped-windowed"])
def test_fast_path_equals_the_reference(fields):
    cfg = partial_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(rotary_dim=4, rms_norm=True, kv_heads=1, qk_norm=True,
                                head_dim=5, d_model=10)):
        rows = torch_reference_rows(partial_cfg(**fields), seed=8)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


@pytest.mark.parametrize("rotary_dim", [2, 4])
def test_matches_hugging_face_gpt_neox_with_its_rotary_pct(rotary_dim):
    """GPT-NeoX turns ``rotary_pct`` of each head: tfm's rotary_dim, loss, logits and every
    gradient of the turned projections to 1e-12, padding included."""
    pytest.importorskip("torch")
    cfg = partial_cfg(d_model=16, heads=2, layers=2, head_bias=False, rotary_dim=rotary_dim)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    neox = neox_from(params, cfg, rotary_dim)
    grads = tfm_grads_matching_hf(neox, params, tfmcli.make_inputs(cfg), cfg)
    H, dh, d = cfg.heads, cfg.d_head, cfg.d_model
    dW = neox.gpt_neox.layers[0].attention.query_key_value.weight.grad.reshape(H, 3, dh, d)
    for j, w in enumerate("QK"):
        theirs = dW[:, j].reshape(d, d).T.numpy()
        np.testing.assert_allclose(grads[f"blocks.0.attn.W_{w}"], theirs, rtol=0,
                                   atol=1e-12 * np.abs(theirs).max())


def test_kv_cache_turns_the_same_dimensions():
    cfg = partial_cfg(batch=1, lengths=None, seq_len=8, rotary_dim=4, kv_heads=1)
    params, steps, _ = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2, 6, 5])
    whole = tfmcli.engine.kv.decode(params, [3, 1, 4, 1, 5, 2, 6, 5], cfg.replace(rotary_dim=None))
    assert np.abs(whole[-1].logits - steps[-1].logits).max() > 1e-3


def test_the_memory_estimate_counts_narrower_tables():
    cfg = partial_cfg(batch=2, seq_len=16, lengths=None)
    whole, part = memory_estimate(cfg.replace(rotary_dim=None)), memory_estimate(cfg)
    assert whole["caches"] - part["caches"] == 2 * 16 * (6 - 2) * 8


def test_tfm_attn_steps_turn_the_first_columns_and_check_the_backward():
    from tfmcli.explain.steps import explain_query_backward, model_head_steps

    cfg = partial_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=11)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    steps = {s.name: s for s in model_head_steps(params, fwd, cfg, 0, 1, 0)}
    assert_scaled_close(steps["Q_rot"].value, fwd.acts["blocks.0.attn.q_rot"][0, 1], floor=1e-14)
    assert steps["K_rot"].formula.endswith(
        ", its first 2 columns only (rotary_dim; the other 4 pass unturned)")
    back = explain_query_backward(fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 1, 0, 5)
    assert_scaled_close(back.dq_turned_back, grads.acts["blocks.0.attn.q"][0, 1, 5], floor=1e-15)


# ---------------------------------------------------------------- the command line

FLAGS = ["-d", 12, "-H", 2, "-T", 6, "--pe", "rope", "--rotary-dim", 2]


def test_the_flag_reaches_the_run_the_panel_and_train():
    data = json.loads(ok("forward", *FLAGS, "--json").stdout)
    assert data["config"]["rotary_dim"] == 2
    panel = " ".join(ok("forward", *FLAGS, "--rope-theta", 500).stdout.replace("│", " ").split())
    assert "rope (theta 500, the first 2 of each head's 6 dimensions)" in panel
    trained = json.loads(ok("train", "--steps", 2, "--pe", "rope", "-d", 16, "--rotary-dim", 4,
                            "--json").stdout)
    assert trained["config"]["rotary_dim"] == 4
    checked = json.loads(ok("check", "--against", "torch", *FLAGS, "--json").stdout)
    assert checked["passed"] is True
    text = " ".join(ok("attn", *FLAGS, "--head", 1).stdout.split())
    assert "its first 2 columns only (rotary_dim; the other 4 pass unturned)" in text


@pytest.mark.parametrize("args, reason", [
    (["--rotary-dim", 3], "rotary_dim=3 is not an even width within a head of 6"),
    (["--rotary-dim", 0], "0 is not allowed (allowed: 1 or more)"),
])
def test_usage_errors_name_the_option(args, reason):
    line = error_line(run("forward", "-d", 12, "-H", 2, "--pe", "rope", *args), 2)
    assert "'--rotary-dim'" in line and reason in line
    line = error_line(run("forward", "--rotary-dim", 2), 2)
    assert "'--rotary-dim'" in line and "pe is 'sinusoidal', not 'rope'" in line


def test_tfm_pe_turns_the_first_dimensions_and_scores_the_rest_as_they_are():
    """``tfm pe --rope --rotary-dim 4`` on a head of 8: two pairs, (0, 2) and (1, 3), at
    ``t / 10000^(2i/4)``; the score of u = (1, ..., 1) / sqrt(8) turned against itself is
    (2 cos(t - s) + 2 cos((t - s) / 100)) / 8 plus the four unturned dimensions' 4/8, here
    written out."""
    data = json.loads(ok("pe", "--rope", "--len", 6, "-d", 8, "--rotary-dim", 4,
                         "--json").stdout)
    t = np.arange(6.0)
    assert_scaled_close(data["angles"], np.stack([t, t / 100.0], axis=1))
    assert np.shape(data["cos"]) == (6, 4)
    offset = np.subtract.outer(t, t)
    want = (2 * np.cos(offset) + 2 * np.cos(offset / 100.0)) / 8 + 4 / 8
    assert_scaled_close(data["score"], want, floor=1e-15)
    shown = " ".join(ok("pe", "--rope", "--len", 6, "-d", 8, "--rotary-dim", 4).stdout.split())
    assert "dimensions 4-7 are not turned" in shown and "+ 4/8 (the unturned dimensions)" in shown


@pytest.mark.parametrize("args, reason", [
    (["--rotary-dim", 4], "it sets how many dimensions RoPE turns; add --rope"),
    (["--rope", "--rotary-dim", 3], "3 is not allowed (allowed: an even number from 2 to the "
     "head's 8: RoPE turns pairs)"),
    (["--rope", "--rotary-dim", 10], "10 is not allowed (allowed: an even number from 2 to the "
     "head's 8: RoPE turns pairs)"),
], ids=["without-rope", "odd", "wider-than-the-head"])
def test_tfm_pes_rotary_dim_is_refused_where_it_cannot_turn(args, reason):
    line = error_line(run("pe", "-d", 8, *args), 2)
    assert "'--rotary-dim'" in line and line.endswith(reason)


# ---------------------------------------------------------------- a Phi-3 folder

PHI3 = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=24, max_position_embeddings=32,
            rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("factor, rotary_dim", [(0.25, 2), (0.75, 6)])
def test_a_phi3_folder_with_partial_rotary_factor_matches_from_pretrained(tmp_path, factor,
                                                                           rotary_dim):
    """Heads of 8: Phi3ForCausalLM turns int(8 * factor) of them, and so does tfm: loss,
    logits and every gradient to 1e-12."""
    transformers = pytest.importorskip("transformers")
    hf_saved(tmp_path, "Phi3", {**PHI3, "partial_rotary_factor": factor})
    loaded = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]])
    assert loaded.cfg.rotary_dim == rotary_dim
    # its angles in float64 over the turned dimensions (in_float64 checks them first)
    model = assert_folder_matches_hf(transformers.Phi3ForCausalLM, tmp_path, loaded)
    assert model.model.rotary_emb.inv_freq.shape == (rotary_dim // 2,)


def test_a_factor_that_leaves_an_odd_width_is_refused(tmp_path):
    hf_saved(tmp_path, "Phi3", {**PHI3, "partial_rotary_factor": 0.375}, "float32")
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith("'partial_rotary_factor' is 0.375, which turns 3 of a head's 8 "
                         "dimensions; RoPE turns pairs, so tfm needs an even number, at least 2")
