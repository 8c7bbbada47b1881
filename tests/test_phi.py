"""Phi checkpoint folders (``"model_type": "phi"``: Phi-1, Phi-1.5, Phi-2): one layer norm a block
read by attention and the MLP side by side (``--parallel-residual --shared-norm``), RoPE on
``partial_rotary_factor`` of each head, GELU's tanh form, biases everywhere, the head's too.
Folders that Hugging Face's ``save_pretrained`` writes from a random PhiForCausalLM, read to the
bit and run against its ``from_pretrained``; Phi-2's hub config; the refusals; Phi-1.5's and
Phi-2's parameter counts.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_bad_weight_named,
    assert_folder_matches_hf,
    assert_written_back,
    error_line,
    float64_rotary,
    hf_saved,
    rewrite_config,
    run,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import phi

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=24, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)   # d_head 8: half of it is two pairs
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_phi_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "Phi", {**SMALL, **config}, dtype, seed)


def phi_in_float64(model, cfg):
    """Phi's RoPE tables made in float64 (it makes them in float32)."""
    float64_rotary(model.model.rotary_emb, cfg.rope_width, cfg.rope_theta, cfg.rope_scaling)
    return model


def phi_grads(model) -> dict:
    """A PhiForCausalLM's gradients under tfm's names."""
    theirs = {"embed.W_E": model.model.embed_tokens.weight.grad,
              "ln_f.gamma": model.model.final_layernorm.weight.grad,
              "ln_f.beta": model.model.final_layernorm.bias.grad,
              "head.b_U": model.lm_head.bias.grad}
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(model.model.layers):
        p, attn, mlp = f"blocks.{i}.", layer.self_attn, layer.mlp
        theirs[p + "ln1.gamma"] = layer.input_layernorm.weight.grad
        theirs[p + "ln1.beta"] = layer.input_layernorm.bias.grad
        for ours, module in (("attn.W_Q", attn.q_proj), ("attn.W_K", attn.k_proj),
                             ("attn.W_V", attn.v_proj), ("attn.W_O", attn.dense),
                             ("ffn.W_1", mlp.fc1), ("ffn.W_2", mlp.fc2)):
            theirs[p + ours] = module.weight.grad.T
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(rotary_dim=4, activation="gelu", kv_heads=None)),
    (dict(partial_rotary_factor=0.25, num_key_value_heads=1, hidden_act="gelu"),
     dict(rotary_dim=2, activation="gelu_erf", kv_heads=1)),
    (dict(tie_word_embeddings=True, partial_rotary_factor=1.0, rope_theta=500.0,
          layer_norm_eps=1e-6),
     dict(tied_head=True, rotary_dim=None, rope_theta=500.0, eps=1e-6)),
], ids=["phi-half-turned", "quarter-turned-mqa-exact-gelu", "tied-whole-head-base-500"])
def test_a_phi_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config, expect):
    state = hf_phi_folder(tmp_path, **config)
    fields = phi.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.parallel_residual, cfg.shared_norm, cfg.rms_norm, cfg.bias, cfg.head_bias) == (
        True, True, False, True, True)
    params = phi.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    np.testing.assert_array_equal(params["blocks.1.attn.W_K"],
                                  state["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params["blocks.0.ln1.beta"],
                                  state["model.layers.0.input_layernorm.bias"])
    np.testing.assert_array_equal(params["head.b_U"], state["lm_head.bias"])
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("Phi checkpoint")
    assert_folder_matches_hf(transformers.PhiForCausalLM, tmp_path, loaded,
                             to_float64=phi_in_float64, grads_of=phi_grads)


def test_a_folder_written_back_is_the_same_file(tmp_path):
    """``phi.from_tfm``: the stored keys and tensors, bit for bit (float32's values are
    float64's exactly)."""
    hf_phi_folder(tmp_path, "float32")
    assert_written_back(phi, tmp_path)


def test_phi_2s_hub_config_is_read_as_hugging_face_reads_it(tmp_path):
    """microsoft/phi-2's config.json keeps ``partial_rotary_factor`` (0.4) and ``rope_theta``
    at the top level, no ``rope_parameters``; left out, the factor is PhiConfig's 0.5.
    PhiForCausalLM's ``rotary_ndims`` agrees each time."""
    transformers = pytest.importorskip("transformers")
    hf_phi_folder(tmp_path, "float32", hidden_size=40, num_attention_heads=2)   # d_head 20
    for change, want in ((dict(partial_rotary_factor=0.4, rope_theta=2500.0), 8),
                         (dict(), 10)):
        rewrite_config(tmp_path, **{"rope_parameters": None, "partial_rotary_factor": None,
                                    **change})
        fields = phi.read_config(tmp_path)
        model = transformers.PhiForCausalLM.from_pretrained(tmp_path)
        assert fields["rotary_dim"] == model.model.layers[0].self_attn.rotary_ndims == want
        assert fields["rope_theta"] == model.config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("change, reason", [
    (dict(qk_layernorm=True), "key 'qk_layernorm' is true (a layer norm of each head's q and "
     "k with biases), which tfm's --qk-norm does not compute"),
    (dict(hidden_act="silu"), "key 'hidden_act' is 'silu'; tfm reads 'gelu', 'gelu_new', "
     "'gelu_pytorch_tanh', 'relu'"),
    (dict(head_dim=4), "key 'head_dim' is 4; tfm reads Phi's heads 16 / 2 wide"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                           "partial_rotary_factor": 0.5}),
     "key 'rope_parameters' has rope_type 'yarn'; tfm turns by RoPE's own angles ('default'), "
     "LLaMA 3.1's ('llama3') or linearly scaled ones ('linear')"),
    (dict(rope_parameters=None, partial_rotary_factor=0.125),
     "key 'partial_rotary_factor' is 0.125, which turns 1 of a head's 8 dimensions; RoPE "
     "turns pairs, so tfm needs an even number, at least 2"),
], ids=["qk-layernorm", "silu", "head-dim", "yarn", "odd-turn"])
def test_a_phi_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_phi_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


@pytest.mark.parametrize("key, shape, reason", [
    ("lm_head.bias", None, "missing key 'lm_head.bias'"),
    ("model.layers.0.mlp.fc1.weight", (12, 16),
     "key 'model.layers.0.mlp.fc1.weight' has shape (12, 16), but config.json says (24, 16)"),
], ids=["missing-head-bias", "half-of-fc1"])
def test_a_weight_missing_or_of_the_wrong_shape_is_named(tmp_path, key, shape, reason):
    hf_phi_folder(tmp_path, "float32")
    ignored = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32)}
    assert_bad_weight_named(phi, tmp_path, key, shape, reason, ignored)


def test_phi_15_and_phi_2_have_their_parameter_counts():
    """microsoft/phi-1_5's and phi-2's sizes: the counts Hugging Face's PhiForCausalLM gives the
    same configs on the meta device."""
    sizes = {1_418_270_720: (2048, 32, 24, 8192, 51200), 2_779_683_840: (2560, 32, 32, 10240,
                                                                        51200)}
    for count, (d, H, L, F, V) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=H, layers=L, d_ff=F, vocab=V, pe="rope",
                            rotary_dim=32, activation="gelu", parallel_residual=True,
                            shared_norm=True)
        assert param_count(cfg) == count
