"""StableLM checkpoint folders (``"model_type": "stablelm"``): LLaMA's names with layer norm (a
gain and a bias) for RMSNorm, biases on q, k and v when ``use_qkv_bias`` says, and RoPE on a
quarter of each head. Folders that Hugging Face's ``save_pretrained`` writes from a random
StableLmForCausalLM, read to the bit and run against its ``from_pretrained``; the defaults; the
refusals; the parameter counts of the real models.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_folder_matches_hf,
    assert_written_back,
    error_line,
    hf_saved,
    rewrite_config,
    run,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import stablelm, tensorfile

SMALL = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
             layer_norm_eps=1e-5, use_qkv_bias=True, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)   # d_head 8: a quarter of it is one pair
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_stablelm_folder(folder, dtype="bfloat16", seed=0, **config):
    """A random StableLmForCausalLM saved by ``save_pretrained`` (``helpers.hf_saved``): its
    layer norms' biases drawn O(1) too."""
    return hf_saved(folder, "StableLm", {**SMALL, **config}, dtype, seed)


@pytest.mark.parametrize("config, rotary_dim", [
    (dict(), 2),
    (dict(tie_word_embeddings=True, num_key_value_heads=4, use_qkv_bias=False), 2),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                           "partial_rotary_factor": 0.75}), 6),
], ids=["untied-gqa-qkv-bias", "tied-mha", "three-quarters"])
def test_a_stablelm_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config,
                                                                         rotary_dim):
    state = hf_stablelm_folder(tmp_path, **config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "stablelm"
    fields = stablelm.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.activation, cfg.rms_norm, cfg.bias, cfg.eps, cfg.rotary_dim) == (
        "swiglu", False, False, 1e-5, rotary_dim)
    assert cfg.qkv_bias == config.get("use_qkv_bias", True)
    params = stablelm.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    for hf, ours in (("model.norm.bias", "ln_f.beta"),
                     ("model.layers.1.input_layernorm.bias", "blocks.1.ln1.beta"),
                     ("model.layers.0.post_attention_layernorm.bias", "blocks.0.ln2.beta"),
                     ("model.layers.0.post_attention_layernorm.weight", "blocks.0.ln2.gamma"),
                     ("model.layers.1.self_attn.k_proj.weight", "blocks.1.attn.W_K")):
        expected = state[hf].T if hf.endswith("proj.weight") else state[hf]
        np.testing.assert_array_equal(params[ours], expected, err_msg=ours)
    assert np.abs(params["ln_f.beta"]).max() > 0.1   # drawn, so that a lost bias would show
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("StableLM checkpoint")
    model = assert_folder_matches_hf(transformers.StableLmForCausalLM, tmp_path, loaded)
    assert model.model.layers[0].self_attn.rotary_ndims == rotary_dim


def test_the_layer_norms_biases_and_the_partial_turn_are_needed(tmp_path):
    """Each difference from LLaMA moves the logits: without the norms' biases, or with RoPE
    on the whole head, tfm's logits would miss Hugging Face's (so the comparison above sees
    both)."""
    hf_stablelm_folder(tmp_path, "float32")
    run_ = tfmcli.load(tmp_path, tokens=TOKENS)
    logits = tfmcli.forward(run_.params, run_.inputs, run_.cfg).acts["logits"]
    unbiased = {name: np.zeros_like(v) if name.endswith(".beta") else v
                for name, v in run_.params.items()}
    whole = run_.cfg.replace(rotary_dim=None)
    for params, cfg in ((unbiased, run_.cfg), (run_.params, whole)):
        other = tfmcli.forward(params, run_.inputs, cfg).acts["logits"]
        assert np.abs(other[0] - logits[0]).max() > 1e-3


def test_a_folder_written_back_is_the_same_folder(tmp_path):
    """``stablelm.from_tfm``: Hugging Face's keys and tensors, the norms' biases among them,
    bit for bit (the float32 folder's values are float64's exactly)."""
    hf_stablelm_folder(tmp_path, "float32")
    assert_written_back(stablelm, tmp_path)


@pytest.mark.parametrize("change", [
    dict(rope_parameters=None, partial_rotary_factor=None, rope_theta=10000.0),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    dict(rope_parameters=None, partial_rotary_factor=0.5, rope_theta=10000.0),
], ids=["none-anywhere", "none-in-rope-parameters", "top-level"])
def test_the_partial_factor_is_read_where_hugging_face_reads_it(tmp_path, change):
    """Left out, a quarter of each head turns; the hub's first configs keep the factor at the
    top level. Each as StableLmConfig reads the same config.json (its ``rotary_ndims``)."""
    transformers = pytest.importorskip("transformers")
    hf_stablelm_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    model = transformers.StableLmForCausalLM.from_pretrained(tmp_path)
    assert stablelm.read_config(tmp_path)["rotary_dim"] == (
        model.model.layers[0].self_attn.rotary_ndims) == 8 * (
            change.get("partial_rotary_factor") or 0.25)


def test_a_config_without_layer_norm_eps_takes_stablelms_default(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_stablelm_folder(tmp_path, "float32")
    rewrite_config(tmp_path, layer_norm_eps=None, rms_norm_eps=0.5)   # the other key ignored
    fields = stablelm.read_config(tmp_path)
    assert fields["eps"] == transformers.StableLmConfig().layer_norm_eps == 1e-5
    assert fields["rms_norm"] is False


@pytest.mark.parametrize("change, reason", [
    (dict(qk_layernorm=True), "key 'qk_layernorm' is True; that is a layer norm of each head's "
     "q and k with a gain per head, where tfm's --qk-norm shares one across heads"),
    (dict(use_parallel_residual="yes"), "key 'use_parallel_residual' is 'yes', not true or "
     "false"),
    (dict(head_dim=4), "key 'head_dim' is 4, and Hugging Face's StableLM gives a head "
     "hidden_size / num_attention_heads = 8 dimensions in attention but head_dim in RoPE's "
     "tables; tfm will not guess which is meant"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.375}),
     "key 'rope_parameters' 'partial_rotary_factor' is 0.375, which turns 3 of a head's 8 "
     "dimensions; RoPE turns pairs, so tfm needs an even number, at least 2"),
    (dict(use_qkv_bias="yes"), "key 'use_qkv_bias' is 'yes', not true or false"),
    (dict(layer_norm_eps="small"), "key 'layer_norm_eps' is 'small', not a number"),
    (dict(hidden_act="relu"),
     "key 'hidden_act' is 'relu'; tfm gates the FFN with 'silu' (swiglu), GELU's tanh "
     "form (geglu) or GELU itself, 'gelu' (geglu_erf)"),
], ids=["qk-layernorm", "parallel", "head-dim", "odd-turn", "qkv-bias", "eps", "gelu"])
def test_a_stablelm_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_stablelm_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


def test_a_layer_norms_bias_missing_is_named(tmp_path):
    """An RMSNorm-like folder (the norms' biases dropped) is not read as a LLaMA under a
    stablelm config: the first missing bias is named."""
    hf_stablelm_folder(tmp_path, "float32")
    fields = stablelm.read_config(tmp_path)
    tensors = stablelm.from_tfm(stablelm.load_params(tmp_path, fields, np.float32), fields)
    tensorfile.write(tmp_path / "model.safetensors",
                     {key: v for key, v in tensors.items() if not key.endswith("norm.bias")})
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith("missing key 'model.layers.0.input_layernorm.bias'")


def test_stablelms_have_their_parameter_counts():
    """stabilityai/stablelm-2-1_6b's and stablelm-3b-4e1t's sizes (their config.json): the
    counts Hugging Face's StableLmForCausalLM gives the same configs on the meta device."""
    sizes = {1_644_515_328: (2048, 24, 5632, 100352, True),
             2_795_443_200: (2560, 32, 6912, 50304, False)}
    for count, (d, L, F, V, qkv_bias) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=32, layers=L, d_ff=F, vocab=V, pe="rope",
                            activation="swiglu", head_bias=False, bias=False,
                            qkv_bias=qkv_bias, rotary_dim=d // 32 // 4)
        assert param_count(cfg) == count


def test_attention_and_the_mlp_side_by_side_are_a_shared_norm_parallel_block(tmp_path):
    """Issue 59: use_parallel_residual was refused as something tfm's block does not compute,
    but Hugging Face computes x + attn(LN1 x) + mlp(LN1 x), with no post_attention_layernorm:
    tfm's --parallel-residual --shared-norm. Read so, it matches from_pretrained."""
    hf_stablelm_folder(tmp_path, "float32", use_parallel_residual=True)
    fields = stablelm.read_config(tmp_path)
    assert (fields["parallel_residual"], fields["shared_norm"]) == (True, True)
    cfg = tfmcli.Config(**fields)
    assert "blocks.0.ln2.gamma" not in param_shapes(cfg)
    transformers = pytest.importorskip("transformers")
    assert_folder_matches_hf(transformers.StableLmForCausalLM, tmp_path,
                             tfmcli.load(tmp_path, tokens=TOKENS))
