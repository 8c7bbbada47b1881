"""Phi-3 checkpoint folders (``"model_type": "phi3"``): LLaMA's model with q, k and v stored as one
``qkv_proj`` and the gate and up projections as one ``gate_up_proj`` a layer. Folders that
Hugging Face's ``save_pretrained`` writes from a random Phi3ForCausalLM, read to the bit and run
against its ``from_pretrained``; the refusals; the parameter counts of the real models.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_bad_weight_named,
    assert_folder_matches_hf,
    assert_written_back,
    error_line,
    hf_saved,
    run,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import llama, phi3, tensorfile

PHI3 = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False)

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-5, rope_theta=1000.0, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_phi3_folder(folder, dtype="bfloat16", seed=0, **config):
    """A random Phi3ForCausalLM saved by ``save_pretrained`` (``helpers.hf_saved``)."""
    return hf_saved(folder, "Phi3", {**SMALL, **config}, dtype, seed)


@pytest.mark.parametrize("config", [
    dict(),
    dict(tie_word_embeddings=True, num_key_value_heads=4),
    dict(sliding_window=3, num_key_value_heads=1),
], ids=["untied-gqa", "tied-mha", "sliding-mqa"])
def test_a_phi3_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config):
    state = hf_phi3_folder(tmp_path, **config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "phi3"
    fields = phi3.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.activation, cfg.rms_norm, cfg.bias, cfg.qkv_bias, cfg.eps) == (
        "swiglu", True, False, False, 1e-5)
    assert cfg.sliding_window == config.get("sliding_window") and cfg.sliding_layers is None
    params = phi3.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    kv = cfg.h_kv * cfg.d_head   # rows of K, and of V, after Q's 16
    for i in range(2):
        m, p = f"model.layers.{i}.", f"blocks.{i}."
        qkv, gate_up = state[m + "self_attn.qkv_proj.weight"], state[m + "mlp.gate_up_proj.weight"]
        assert qkv.shape == (16 + 2 * kv, 16) and gate_up.shape == (48, 16)
        for name, rows in (("attn.W_Q", qkv[:16]), ("attn.W_K", qkv[16:16 + kv]),
                           ("attn.W_V", qkv[16 + kv:]), ("ffn.W_gate", gate_up[:24]),
                           ("ffn.W_1", gate_up[24:]),
                           ("attn.W_O", state[m + "self_attn.o_proj.weight"])):
            np.testing.assert_array_equal(params[p + name], rows.T, err_msg=p + name)
            assert params[p + name].flags.c_contiguous
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("Phi-3 checkpoint")
    assert_folder_matches_hf(transformers.Phi3ForCausalLM, tmp_path, loaded)


def test_the_window_needs_to_be_read(tmp_path):
    """A window of 3 on 7 tokens hides keys: without it, tfm's logits would miss Hugging
    Face's (so the comparison above sees the window)."""
    hf_phi3_folder(tmp_path, "float32", sliding_window=3)
    windowed = tfmcli.load(tmp_path, tokens=TOKENS)
    fwd = tfmcli.forward(windowed.params, windowed.inputs, windowed.cfg)
    full = windowed.cfg.replace(sliding_window=None)
    other = tfmcli.forward(windowed.params, windowed.inputs, full)
    assert np.abs(fwd.acts["logits"][0, 3:] - other.acts["logits"][0, 3:]).max() > 1e-3
    np.testing.assert_array_equal(fwd.acts["logits"][0, :3], other.acts["logits"][0, :3])


def test_a_folder_written_back_is_the_same_folder(tmp_path):
    """``phi3.from_tfm`` fuses the matrices again: Hugging Face's keys and tensors, bit for
    bit (the float32 folder's values are float64's exactly)."""
    hf_phi3_folder(tmp_path, "float32")
    fields = assert_written_back(phi3, tmp_path)
    assert [key for key, _, _ in phi3.name_map(fields)][1:4] == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight"]


def test_a_config_without_rms_norm_eps_takes_phi3s_default(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_phi3_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert phi3.read_config(tmp_path)["eps"] == transformers.Phi3Config().rms_norm_eps == 1e-5
    assert transformers.LlamaConfig().rms_norm_eps == 1e-6   # Phi-3's own default, not LLaMA's


def test_attention_bias_adds_no_biases_as_in_hugging_faces_phi3(tmp_path):
    """Phi3Attention's qkv_proj and o_proj have no bias whatever the config says: a folder
    with attention_bias (and mlp_bias) true is read without biases, and from_pretrained makes
    none either."""
    transformers = pytest.importorskip("transformers")
    hf_phi3_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(attention_bias=True, mlp_bias=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields = phi3.read_config(tmp_path)
    assert (fields["bias"], fields["qkv_bias"]) == (False, False)
    model = transformers.Phi3ForCausalLM.from_pretrained(tmp_path)
    assert not [name for name, _ in model.named_parameters() if name.endswith(".bias")]


@pytest.mark.parametrize("change, reason", [
    (dict(partial_rotary_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "key 'partial_rotary_factor' is 1.5, not a number in (0, 1]"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.125}),
     "key 'rope_parameters' 'partial_rotary_factor' is 0.125, which turns 0 of a head's 4 "
     "dimensions; RoPE turns pairs, so tfm needs an even number, at least 2"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 2,
                           "long_factor": [2.0] * 2, "original_max_position_embeddings": 16}),
     "key 'rope_parameters' has rope_type 'longrope'; tfm turns by RoPE's own angles "
     "('default'), LLaMA 3.1's ('llama3') or linearly scaled ones ('linear')"),
    (dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
     "key 'layer_types' has 'full_attention' layers, which Hugging Face's Phi-3 does not read "
     "(its window is in every layer); tfm will not guess which is meant"),
    (dict(hidden_act="relu"),
     "key 'hidden_act' is 'relu'; tfm gates the FFN with 'silu' (swiglu), GELU's tanh "
     "form (geglu) or GELU itself, 'gelu' (geglu_erf)"),
], ids=["partial-over-1", "partial-none-turned", "longrope", "full-layers", "gelu"])
def test_a_phi3_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_phi3_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


@pytest.mark.parametrize("key, shape, reason", [
    ("model.layers.1.self_attn.qkv_proj.weight", None,
     "missing key 'model.layers.1.self_attn.qkv_proj.weight'"),
    ("model.layers.0.mlp.gate_up_proj.weight", (24, 16),
     "key 'model.layers.0.mlp.gate_up_proj.weight' has shape (24, 16), but config.json says "
     "(48, 16)"),
], ids=["missing", "gate-up-half"])
def test_a_fused_weight_missing_or_of_the_wrong_shape_is_named(tmp_path, key, shape, reason):
    hf_phi3_folder(tmp_path, "float32")
    assert_bad_weight_named(phi3, tmp_path, key, shape, reason)


def test_an_unfused_llama_layout_is_not_a_phi3s(tmp_path):
    """A phi3 folder holding LLaMA's separate q_proj (say, a hand-converted one) is named at
    its first foreign key rather than read as something else."""
    hf_phi3_folder(tmp_path, "float32")
    fields = phi3.read_config(tmp_path)
    tensors = llama.from_tfm(phi3.load_params(tmp_path, fields, np.float32), fields)
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith("unknown key 'model.layers.0.self_attn.q_proj.weight' (not a weight of "
                         "the Phi-3 that config.json describes)")


def test_phi3s_have_their_parameter_counts():
    """microsoft/Phi-3-mini-4k-instruct's, Phi-3-medium-4k-instruct's and phi-4's sizes (their
    config.json): the counts Hugging Face's Phi3ForCausalLM gives the same configs on the meta
    device (the head untied)."""
    sizes = {3_821_079_552: (3072, 32, 32, 32, 8192, 32064),
             13_960_238_080: (5120, 40, 10, 40, 17920, 32064),
             14_659_507_200: (5120, 40, 10, 40, 17920, 100352)}
    for count, (d, H, kv, L, F, V) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=H, kv_heads=kv, layers=L, d_ff=F, vocab=V, **PHI3)
        assert param_count(cfg) == count
