"""Qwen2's attention biases (``qkv_bias``, ``--qkv-bias``: b_Q, b_K, b_V under ``--no-bias``) and
Qwen2 checkpoint folders (``"model_type": "qwen2"``). The model at random O(1) parameters against
central differences, the torch reference and Hugging Face's Qwen2ForCausalLM; folders that
Hugging Face's ``save_pretrained`` writes, read to the bit and run against ``from_pretrained``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_folder_matches_hf,
    assert_gradcheck_passes,
    assert_grads_match,
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
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import llama, qwen2

QWEN2 = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False,
             qkv_bias=True)


def qwen2_cfg(**fields):
    base = dict(d_model=16, heads=4, kv_heads=2, seq_len=5, lengths=(5, 3), d_ff=12,
                rope_theta=1000.0, **QWEN2)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the model


def test_q_k_and_v_have_biases_and_nothing_else_does():
    shapes = param_shapes(qwen2_cfg())
    assert [name for name in shapes if ".b_" in name and name.startswith("blocks.0.")] == [
        "blocks.0.attn.b_Q", "blocks.0.attn.b_K", "blocks.0.attn.b_V"]
    assert shapes["blocks.0.attn.b_K"] == (8,)   # 2 key heads of 4
    # with every bias on, qkv_bias adds nothing
    assert param_shapes(qwen2_cfg(bias=True)) == param_shapes(qwen2_cfg(bias=True, qkv_bias=False))


def test_qwen2_5_0_5b_has_its_parameter_count():
    """Qwen/Qwen2.5-0.5B's sizes (its config.json): 494,032,768 parameters, the tied embedding
    counted once (its model card's 0.49B)."""
    cfg = tfmcli.Config(d_model=896, heads=14, kv_heads=2, layers=24, d_ff=4864, vocab=151936,
                        tied_head=True, **QWEN2)
    assert param_count(cfg) == 494_032_768


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2, kv_heads=None),
                                    dict(pe="sinusoidal", causal=False)],
                         ids=["qwen2", "post-L2", "sinusoidal-bidirectional"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    report = assert_gradcheck_passes(qwen2_cfg(**fields))
    checked = {c.name for c in report.params}
    assert {"blocks.0.attn.b_Q", "blocks.0.attn.b_K", "blocks.0.attn.b_V"} <= checked
    assert not [name for name in checked if name.endswith(("b_O", "b_1", "b_2", "b_gate"))]


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post"), dict(dtype="float32")):
        rows = torch_reference_rows(qwen2_cfg(**fields), seed=9)
        assert any(r.name == "grad blocks.0.attn.b_V" for r in rows)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_hugging_face_qwen2(tied):
    """Qwen2ForCausalLM (q, k and v with biases, o and the MLP without; 2 key heads of 4) holding
    tfm's random parameters: loss, logits and every gradient, padding included."""
    pytest.importorskip("torch")
    cfg = qwen2_cfg(layers=2, tied_head=tied)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = llama_from(params, cfg, qwen2=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.o_proj.bias is None
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params) == set(grads)
    assert_grads_match(grads, theirs)


def test_a_bare_npz_with_biases_on_q_k_v_loads_as_qwen2(tmp_path):
    cfg = qwen2_cfg(pe="sinusoidal", lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    path = tmp_path / "bare.npz"
    np.savez(path, **{f"param/{name}": value for name, value in params.items()})
    out = json.loads(ok("forward", "--load", path, "-H", 4, "--kv-heads", 2, "-T", 5,
                        "--activation", "swiglu", "--json").stdout)
    assert out["config"]["bias"] is False and out["config"]["qkv_bias"] is True
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg.replace(seed=out["config"]["seed"])), cfg)
    assert out["loss"] == pytest.approx(fwd.loss, rel=1e-12)


# ---------------------------------------------------------------- the command line


def test_qkv_bias_on_the_command_line():
    assert error_line(run("forward", "--qkv-bias"), 2) == (
        "tfm forward: error: Invalid value for '--qkv-bias': it gives Q, K and V biases in a "
        "model whose --bias gives every layer one; add --no-bias")
    panel = ok("forward", "--no-bias", "--qkv-bias").stdout
    assert "Q, K and V only (b_Q, b_K, b_V)" in panel
    out = json.loads(ok("backward", "--no-bias", "--qkv-bias", "--json").stdout)
    names = {g["name"] for g in out["gradients"]}
    assert "blocks.0.attn.b_Q" in names and "blocks.0.attn.b_O" not in names
    text = ok("attn", "--no-bias", "--qkv-bias").stdout
    assert "Q = X W_Q + b_Q" in text


# ---------------------------------------------------------------- checkpoint folders


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6, rope_theta=1000000.0)


def hf_qwen2_folder(folder, dtype="bfloat16", seed=0, **config):
    """A random Qwen2ForCausalLM saved by ``save_pretrained`` (``helpers.hf_saved``)."""
    return hf_saved(folder, "Qwen2", {**SMALL, **config}, dtype, seed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_qwen2_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, tied):
    state = hf_qwen2_folder(tmp_path, tie_word_embeddings=tied)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    fields = qwen2.read_config(tmp_path)
    params = qwen2.load_params(tmp_path, fields, np.float64)
    cfg = tfmcli.Config(**fields)
    assert cfg.qkv_bias and not cfg.bias and cfg.rope_theta == 1e6 and cfg.tied_head == tied
    assert list(params) == list(param_shapes(cfg))
    for key, name, transposed in llama.name_map(fields):
        np.testing.assert_array_equal(params[name], state[key].T if transposed else state[key],
                                      err_msg=key)
    transformers = pytest.importorskip("transformers")
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Qwen2 checkpoint")
    assert_folder_matches_hf(transformers.Qwen2ForCausalLM, tmp_path, run_)


def test_an_unknown_key_names_qwen2(tmp_path):
    from tfmcli.sources import tensorfile

    hf_qwen2_folder(tmp_path, "float32")
    fields = qwen2.read_config(tmp_path)
    tensors = llama.from_tfm(qwen2.load_params(tmp_path, fields, np.float32), fields)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(16, np.float32)
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    assert error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1).endswith(
        "unknown key 'model.layers.0.self_attn.o_proj.bias' (not a weight of the Qwen2 that "
        "config.json describes)")
