"""GPT-NeoX checkpoint folders (``"model_type": "gpt_neox"``: Pythia, GPT-NeoX-20B): layer norms
with biases, ``query_key_value`` interleaved head by head, RoPE on ``rotary_pct`` of each head,
the parallel residual, GELU itself. Folders that Hugging Face's ``save_pretrained`` writes from
a random GPTNeoXForCausalLM, read to the bit and run against its ``from_pretrained``; the first
configs' keys; the refusals; Pythia's parameter counts.
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
from tfmcli.sources import gpt_neox

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=24, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)   # d_head 8: a quarter of it is one pair
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_neox_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "GPTNeoX", {**SMALL, **config}, dtype, seed)


def neox_in_float64(model, cfg):
    """GPT-NeoX's RoPE tables made in float64 (it makes them in float32); its LayerNorms are
    float64's already."""
    float64_rotary(model.gpt_neox.rotary_emb, cfg.rope_width, cfg.rope_theta, cfg.rope_scaling)
    return model


def neox_grads(model) -> dict:
    """A GPTNeoXForCausalLM's gradients under tfm's names; ``query_key_value``'s rows cut as
    its attention cuts them (viewed ``(H, 3 d_head)``, then chunked in three)."""
    H = model.config.num_attention_heads
    theirs = {"embed.W_E": model.gpt_neox.embed_in.weight.grad,
              "ln_f.gamma": model.gpt_neox.final_layer_norm.weight.grad,
              "ln_f.beta": model.gpt_neox.final_layer_norm.bias.grad}
    if model.lm_head.weight is not model.gpt_neox.embed_in.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(model.gpt_neox.layers):
        p, attn, mlp = f"blocks.{i}.", layer.attention, layer.mlp
        qkv_w = attn.query_key_value.weight.grad.reshape(H, 3, -1, SMALL["hidden_size"])
        for j, w in enumerate("QKV"):
            theirs[p + f"attn.W_{w}"] = qkv_w[:, j].reshape(-1, SMALL["hidden_size"]).T
            if attn.query_key_value.bias is not None:   # attention_bias false: none
                qkv_b = attn.query_key_value.bias.grad.reshape(H, 3, -1)
                theirs[p + f"attn.b_{w}"] = qkv_b[:, j].reshape(-1)
        for ours, module in (("ln1", layer.input_layernorm),
                             ("ln2", layer.post_attention_layernorm)):
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (module.weight.grad,
                                                                       module.bias.grad)
        for ours, module in (("attn.W_O", attn.dense), ("ffn.W_1", mlp.dense_h_to_4h),
                             ("ffn.W_2", mlp.dense_4h_to_h)):
            theirs[p + ours] = module.weight.grad.T
            if module.bias is not None:
                theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(parallel_residual=True, activation="gelu_erf", rotary_dim=2)),
    (dict(use_parallel_residual=False, hidden_act="gelu_new", rotary_pct=0.5),
     dict(parallel_residual=False, activation="gelu", rotary_dim=4)),
    (dict(tie_word_embeddings=True, rotary_pct=1.0, rotary_emb_base=500),
     dict(tied_head=True, rotary_dim=None, rope_theta=500.0)),
    (dict(attention_bias=False), dict(bias=False, ffn_bias=True)),
], ids=["pythia", "sequential-tanh-half", "tied-whole-head-base-500", "mlp-biases-alone"])
def test_a_gpt_neox_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config,
                                                                         expect):
    state = hf_neox_folder(tmp_path, **config)
    fields = gpt_neox.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.rms_norm, cfg.bias or cfg.ffn_bias, cfg.head_bias, cfg.eps) == (
        False, True, False, 1e-5)
    params = gpt_neox.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    qkv = state["gpt_neox.layers.1.attention.query_key_value.weight"].reshape(2, 3, 8, 16)
    for j, w in enumerate("QKV"):   # head h's rows of q: qkv rows 24 h .. 24 h + 7
        np.testing.assert_array_equal(params[f"blocks.1.attn.W_{w}"], qkv[:, j].reshape(16, 16).T)
        assert params[f"blocks.1.attn.W_{w}"].flags.c_contiguous
    if cfg.bias:
        bias = state["gpt_neox.layers.0.attention.query_key_value.bias"]
        np.testing.assert_array_equal(params["blocks.0.attn.b_K"],
                                      np.r_[bias[8:16], bias[32:40]])
    else:
        assert not [name for name in params if ".attn.b_" in name]
    np.testing.assert_array_equal(params["blocks.1.ffn.b_2"],
                                  state["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"])
    np.testing.assert_array_equal(params["ln_f.beta"], state["gpt_neox.final_layer_norm.bias"])
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("GPT-NeoX checkpoint")
    assert_folder_matches_hf(transformers.GPTNeoXForCausalLM, tmp_path, loaded,
                             to_float64=neox_in_float64, grads_of=neox_grads)


def test_a_folder_written_back_is_the_same_file(tmp_path):
    """``gpt_neox.from_tfm`` interleaves q, k and v again: the stored keys and tensors, bit for
    bit (float32's values are float64's exactly)."""
    hf_neox_folder(tmp_path, "float32")
    assert_written_back(gpt_neox, tmp_path)


def test_the_first_configs_keys_are_read_as_hugging_face_reads_them(tmp_path):
    """Pythia's config.json on the hub: ``rotary_pct`` and ``rotary_emb_base`` at the top
    level, no ``rope_parameters``; GPTNeoXConfig's ``rotary_ndims`` and base agree."""
    transformers = pytest.importorskip("transformers")
    hf_neox_folder(tmp_path, "float32")
    rewrite_config(tmp_path, rope_parameters=None, rotary_pct=0.5, rotary_emb_base=2500)
    fields = gpt_neox.read_config(tmp_path)
    model = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path)
    assert fields["rotary_dim"] == model.gpt_neox.layers[0].attention.rotary_ndims == 4
    assert fields["rope_theta"] == model.config.rope_parameters["rope_theta"] == 2500


@pytest.mark.parametrize("change, reason", [
    (dict(attention_bias="no"), "key 'attention_bias' is 'no', not true or false"),
    (dict(hidden_act="silu"), "key 'hidden_act' is 'silu'; tfm reads 'gelu', 'gelu_new', "
     "'gelu_pytorch_tanh', 'relu'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "key 'rope_parameters' has rope_type 'yarn'; tfm turns by RoPE's own angles ('default'), "
     "LLaMA 3.1's ('llama3') or linearly scaled ones ('linear')"),
    (dict(rope_parameters=None, rotary_pct=0.1875),
     "key 'rotary_pct' is 0.1875, which turns 1 of a head's 8 dimensions; RoPE "
     "turns pairs, so tfm needs an even number, at least 2"),
    (dict(use_parallel_residual="yes"), "key 'use_parallel_residual' is 'yes', not true or "
     "false"),
], ids=["attention-bias", "silu", "yarn", "odd-turn", "parallel-type"])
def test_a_gpt_neox_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_neox_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


@pytest.mark.parametrize("key, shape, reason", [
    ("gpt_neox.layers.1.attention.query_key_value.bias", None,
     "missing key 'gpt_neox.layers.1.attention.query_key_value.bias'"),
    ("gpt_neox.layers.0.attention.query_key_value.weight", (16, 16),
     "key 'gpt_neox.layers.0.attention.query_key_value.weight' has shape (16, 16), but "
     "config.json says (48, 16)"),
], ids=["missing", "a-third"])
def test_a_weight_missing_or_of_the_wrong_shape_is_named(tmp_path, key, shape, reason):
    hf_neox_folder(tmp_path, "float32")
    ignored = {"gpt_neox.layers.0.attention.masked_bias": np.float32(-1e9)}   # a buffer
    assert_bad_weight_named(gpt_neox, tmp_path, key, shape, reason, ignored)


def test_pythias_have_their_parameter_counts():
    """EleutherAI/pythia-70m's, 1b's and 12b's sizes: the counts Hugging Face's
    GPTNeoXForCausalLM gives the same configs on the meta device."""
    sizes = {70_426_624: (512, 8, 6, 2048, 50304), 1_011_781_632: (2048, 8, 16, 8192, 50304),
             11_846_072_320: (5120, 40, 36, 20480, 50688)}
    for count, (d, H, L, F, V) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=H, layers=L, d_ff=F, vocab=V, pe="rope",
                            rotary_dim=d // H // 4, head_bias=False, activation="gelu_erf",
                            parallel_residual=True)
        assert param_count(cfg) == count
