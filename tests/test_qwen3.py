"""Normalised queries and keys (``qk_norm``, ``--qk-norm``: Qwen3's ``q_norm`` and ``k_norm``,
each head's q and k normalised over its d_head entries before RoPE) and Qwen3 checkpoint folders
(``"model_type": "qwen3"``). The model at random O(1) parameters (every gamma, beta and bias
drawn) against central differences, its own reference path, the torch reference and Hugging
Face's Qwen3ForCausalLM; folders that ``save_pretrained`` writes, read to the bit and run
against ``from_pretrained``; the head's steps and the views.
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
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    hf_saved,
    llama_from,
    llama_grads,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine import ops
from tfmcli.engine.sizes import activation_shapes, memory_estimate, param_count, param_shapes
from tfmcli.sources import llama, qwen3

QWEN3 = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False,
             qk_norm=True)


def qwen3_cfg(**fields):
    """Qwen3's shape, small: 4 heads 6 wide on a width of 16, 2 key heads, a padded row."""
    base = dict(d_model=16, heads=4, kv_heads=2, head_dim=6, seq_len=6, lengths=(6, 4),
                d_ff=12, rope_theta=1e6, **QWEN3)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- shapes and counts


def test_each_block_has_a_norm_for_queries_and_one_for_keys():
    shapes = param_shapes(qwen3_cfg())
    assert {n: s for n, s in shapes.items() if "_norm" in n and n.startswith("blocks.0.")} == {
        "blocks.0.attn.q_norm.gamma": (6,), "blocks.0.attn.k_norm.gamma": (6,)}
    layer_norm = param_shapes(qwen3_cfg(rms_norm=False))   # with layer norm, a beta each too
    assert layer_norm["blocks.0.attn.k_norm.beta"] == (6,)
    assert tfmcli.engine.sizes.param_groups(qwen3_cfg())["attn"] == (
        16 * 24 + 2 * 16 * 12 + 24 * 16 + 2 * 6) * 1
    acts = list(activation_shapes(qwen3_cfg()))
    at = acts.index("blocks.0.attn.v")
    assert acts[at + 1:at + 5] == ["blocks.0.attn.q_norm.out", "blocks.0.attn.k_norm.out",
                                   "blocks.0.attn.q_rot", "blocks.0.attn.k_rot"]


def test_qwen3_0_6b_has_its_parameter_count():
    """Qwen/Qwen3-0.6B's sizes (its config.json): 596,049,920 parameters, the count Hugging
    Face's Qwen3ForCausalLM gives the same config (the tied embedding counted once)."""
    cfg = tfmcli.Config(d_model=1024, heads=16, kv_heads=8, head_dim=128, layers=28, d_ff=3072,
                        vocab=151936, tied_head=True, **QWEN3)
    assert param_count(cfg) == 596_049_920


def test_the_memory_estimate_counts_the_normalised_arrays():
    """Two (B, H, T, d_head) and two (B, H_kv, T, d_head) arrays a block (q and k normalised,
    their gradients), and each norm's cache (xhat and one rstd a row)."""
    cfg = qwen3_cfg(lengths=None, layers=3)
    plain = memory_estimate(cfg.replace(qk_norm=False))
    normed = memory_estimate(cfg)
    B, T, L = 2, 6, 3
    q, k = B * 4 * T * 6, B * 2 * T * 6
    assert normed["activations"] - plain["activations"] == L * (q + k) * 8
    assert normed["activation grads"] - plain["activation grads"] == L * (q + k) * 8
    assert normed["caches"] - plain["caches"] == L * (q + k + B * T * (4 + 2)) * 8


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [
    dict(),
    dict(pe="sinusoidal", rms_norm=False, bias=True, head_bias=True, kv_heads=None,
         head_dim=None, activation="gelu"),
    dict(norm="post", layers=2, head_dim=3, kv_heads=1, rms_norm=False),
], ids=["qwen3", "layernorm-betas-biases", "post-L2-mqa"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(qwen3_cfg(**fields))
    checked = {c.name for c in report.params}
    assert {"blocks.0.attn.q_norm.gamma", "blocks.0.attn.k_norm.gamma"} <= checked


def test_k_norms_beta_gets_no_gradient_without_rope():
    """A beta added to every key of a head adds q . beta to every score of a query: the softmax
    does not see it, so its gradient is 0 but for rounding, as b_K's is. q_norm's beta is
    not so; nor is k_norm's under RoPE, which turns the beta of each key by its position."""
    for pe, zero in (("sinusoidal", True), ("rope", False)):
        cfg = qwen3_cfg(rms_norm=False, pe=pe)
        params = random_params(tfmcli.init_params(cfg), seed=3)
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        grads = tfmcli.backward(params, fwd, cfg)
        largest = max(np.abs(g).max() for g in grads.values())
        assert (np.abs(grads["blocks.0.attn.k_norm.beta"]).max() < 1e-14 * largest) == zero
        assert np.abs(grads["blocks.0.attn.q_norm.beta"]).max() > 1e-3 * largest


def test_the_norms_change_the_numbers():
    """The normalised q has unit RMS over each head's entries (times gamma); dropping the
    norms moves the loss."""
    cfg = qwen3_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=5)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    normed = fwd.acts["blocks.0.attn.q_norm.out"] / params["blocks.0.attn.q_norm.gamma"]
    np.testing.assert_allclose(np.sqrt((normed ** 2).mean(axis=-1)), 1.0, rtol=0, atol=1e-4)
    plain = cfg.replace(qk_norm=False)
    kept = {n: v for n, v in params.items() if "_norm" not in n}
    assert abs(fwd.loss - tfmcli.forward(kept, inputs, plain).loss) > 1e-3


@pytest.mark.parametrize("fields", [
    dict(batch=2, seq_len=300, lengths=(300, 150), d_model=32),
    dict(batch=2, seq_len=256, lengths=None, d_model=64, heads=4, kv_heads=4, head_dim=24,
         rms_norm=False, bias=True, pe="sinusoidal", activation="relu"),
], ids=["T300-padded", "layernorm-512-rows-in-parts"])
def test_the_fast_path_equals_the_reference(fields):
    cfg = qwen3_cfg(**fields)
    assert_fast_equals_reference(cfg, random_params(tfmcli.init_params(cfg), seed=2),
                                 tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", rms_norm=False), dict(dtype="float32"),
                   dict(pe="learned", head_dim=None, sliding_window=3)):
        torch_reference_rows(qwen3_cfg(**fields), seed=11)


@pytest.mark.parametrize("fields", [dict(), dict(tied_head=True, sliding_window=2)],
                         ids=["untied", "tied-window"])
def test_matches_hugging_face(fields):
    """Qwen3ForCausalLM holding tfm's random parameters (its q_norm and k_norm weights tfm's
    gammas): loss, logits and every gradient, the norms' included, a padded row too."""
    pytest.importorskip("torch")
    cfg = qwen3_cfg(layers=2, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = llama_from(params, cfg, qwen3=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_the_kv_cache_equals_the_forward():
    cfg = qwen3_cfg(seq_len=7, lengths=None, batch=1, vocab=10, layers=2)
    decoded_like_the_forward(cfg, 6, [3, 1, 4, 1, 5, 9, 2])


def test_a_file_without_its_config_is_read_with_its_norms(tmp_path):
    """An npz of parameters alone: q_norm's gamma means qk_norm (and W_Q 24 wide on 16, heads
    of 6 for -H 4)."""
    cfg = qwen3_cfg(lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    path = tmp_path / "bare.npz"
    np.savez(path, **{"param/" + name: value for name, value in params.items()})
    data = json.loads(ok("forward", "--load", path, "-H", 4, "-T", 6, "--pe", "rope",
                         "--rope-theta", 1e6, "--json").stdout)
    assert data["config"]["qk_norm"] is True and data["config"]["head_dim"] == 6
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    assert data["loss"] == pytest.approx(fwd.loss, rel=1e-12)


# ---------------------------------------------------------------- one head, step by step


@pytest.mark.parametrize("fields", [dict(), dict(pe="sinusoidal", rms_norm=False)],
                         ids=["rope-rms", "layernorm"])
def test_the_heads_steps_normalise_q_and_k(fields):
    """tfm attn's steps: Q_norm and K_norm between K, V and the scores (under RoPE, the turn
    of the normalised ones); the backward's dQ_norm and dK_norm, then dQ and dK through the
    norms, each equal to the backward pass's own."""
    from tfmcli.explain import steps

    cfg = qwen3_cfg(batch=1, lengths=None, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    shown = {s.name: s.value for s in steps.model_head_steps(params, fwd, cfg, 0, 3, 0)}
    names = list(shown)
    assert names[4:6] == ["Q_norm", "K_norm"]
    assert_scaled_close(shown["Q_norm"], fwd.acts["blocks.0.attn.q_norm.out"][0, 3], floor=1e-13)
    assert_scaled_close(shown["K_norm"], fwd.acts["blocks.0.attn.k_norm.out"][0, 1], floor=1e-13)
    back = {s.name: s.value for s in steps.model_head_backward_steps(
        fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 2, 0)}
    # head 2 is the first of key head 1's two query heads: its dQ is all of q's gradient
    assert_scaled_close(back["dQ_norm"], grads.acts["blocks.0.attn.q_norm.out"][0, 2], floor=1e-15)
    assert_scaled_close(back["dQ"], grads.acts["blocks.0.attn.q"][0, 2], floor=1e-15)
    # a key head's dK is the sum of its two query heads' shares
    other = {s.name: s.value for s in steps.model_head_backward_steps(
        fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 3, 0)}
    assert_scaled_close(back["dK"] + other["dK"], grads.acts["blocks.0.attn.k"][0, 1], floor=1e-15)


def test_tfm_attn_shows_the_norms_and_checks_their_backward():
    args = ["--qk-norm", "--rms-norm", "--pe", "rope", "-d", 8, "-H", 2, "--head-dim", 3,
            "-T", 5, "--kv-heads", 1]
    data = json.loads(ok("attn", *args, "--head", 1, "--backward", "--json").stdout)
    assert [s["name"] for s in data["steps"]][4:8] == ["Q_norm", "K_norm", "Q_rot", "K_rot"]
    assert [s["name"] for s in data["backward_steps"]][6:] == ["dQ_norm", "dK_norm", "dQ", "dK"]
    assert data["backward_model_diff"] < 1e-15
    text = ok("attn", *args, "--head", 1).stdout
    assert "RMSNorm of each row: Q / sqrt(mean(Q^2) + eps) * q_norm.gamma" in text
    assert "RoPE: Q_norm cos + rotate_half(Q_norm) sin" in " ".join(text.split())
    query = json.loads(ok("attn", "--qk-norm", "-T", 5, "--query", 3, "--backward",
                          "--json").stdout)
    assert query["backward"]["dq_model_diff"] < 1e-15
    assert query["backward"]["dq_numeric_diff"] < 1e-9
    text = ok("attn", "--qk-norm", "-T", 5, "--query", 3, "--backward").stdout
    assert "differs from the backward pass's own (attn.q_norm.out)" in " ".join(text.split())


def test_the_command_line_takes_qk_norm():
    panel = ok("forward", "--qk-norm").stdout
    assert "q, k norm      each head's, before the scores (attn.q_norm, attn.k_norm)" in panel
    out = json.loads(ok("backward", "--qk-norm", "--json").stdout)
    names = {g["name"] for g in out["gradients"]}
    assert {"blocks.0.attn.q_norm.gamma", "blocks.0.attn.q_norm.beta"} <= names
    out = json.loads(ok("train", "--steps", 3, "--qk-norm", "--json").stdout)
    assert out["config"]["qk_norm"] is True
    out = json.loads(ok("check", "--against", "torch", "--qk-norm", "--rms-norm", "--head-dim", 4,
                        "--json").stdout)
    assert out["passed"] is True


# ---------------------------------------------------------------- checkpoint folders


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6, rope_theta=1000000.0)


def hf_qwen3_folder(folder, dtype="bfloat16", seed=0, **config):
    """A random Qwen3ForCausalLM saved by ``save_pretrained`` (``helpers.hf_saved``)."""
    return hf_saved(folder, "Qwen3", {**SMALL, **config}, dtype, seed)


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=True)],
                         ids=["untied", "tied"])
def test_a_qwen3_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config):
    state = hf_qwen3_folder(tmp_path, **config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    fields = qwen3.read_config(tmp_path)
    params = qwen3.load_params(tmp_path, fields, np.float64)
    cfg = tfmcli.Config(**fields)
    assert cfg.qk_norm and cfg.d_head == 6 and not cfg.bias and not cfg.qkv_bias
    assert list(params) == list(param_shapes(cfg))
    for key, name, transposed in llama.name_map(fields):
        np.testing.assert_array_equal(params[name], state[key].T if transposed else state[key],
                                      err_msg=key)
    assert "model.layers.1.self_attn.k_norm.weight" in dict(
        (key, name) for key, name, _ in llama.name_map(fields))
    transformers = pytest.importorskip("transformers")
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Qwen3 checkpoint")
    assert_folder_matches_hf(transformers.Qwen3ForCausalLM, tmp_path, run_)


def test_a_qwen3_config_without_head_dim_takes_qwen3s_default(tmp_path):
    hf_qwen3_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert qwen3.read_config(tmp_path)["head_dim"] == 128   # Qwen3Config's default


@pytest.mark.parametrize("change, reason", [
    (dict(attention_bias=True),
     "key 'attention_bias' is True; tfm adds biases to all of attention and the FFN (--bias) or "
     "to Q, K and V alone (--qkv-bias), and a Qwen3's would be on o_proj too and not in the MLP"),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers="1"),
     "key 'max_window_layers' is '1', not a number"),
], ids=["attention-bias", "max-window-layers-not-a-number"])
def test_a_qwen3_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_qwen3_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    config.pop("layer_types", None)   # as an older config has it
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


def test_a_missing_norm_weight_is_named(tmp_path):
    from tfmcli.sources import tensorfile

    hf_qwen3_folder(tmp_path, "float32")
    fields = qwen3.read_config(tmp_path)
    tensors = llama.from_tfm(qwen3.load_params(tmp_path, fields, np.float32), fields)
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    assert error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1).endswith(
        "missing key 'model.layers.1.self_attn.q_norm.weight'")


def test_the_norm_is_rmsnorm_over_each_heads_entries():
    """By hand: a head's q of (3, 4) over d_head 2 is normalised pair by pair."""
    q = np.array([[[[3.0, 4.0]]]])                         # (B, H, T, d_head) = (1, 1, 1, 2)
    out, _ = ops.rms_norm_forward(q, np.array([1.0, 2.0]), 0.0)
    rms = np.sqrt((9 + 16) / 2)
    assert_scaled_close(out[0, 0, 0], [3 / rms, 2 * 4 / rms])
