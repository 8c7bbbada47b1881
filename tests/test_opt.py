"""OPT checkpoint folders (``"model_type": "opt"``): learned positions whose table starts two rows
in, layer norms with biases before each sublayer (after them, Post-LN, when
``do_layer_norm_before`` is false), biases everywhere but the head, tied to the embedding.
Folders that Hugging Face's ``save_pretrained`` writes from a random OPTForCausalLM, read to the
bit and run against its ``from_pretrained``; written back; the refusals; OPT-125M's and 1.3B's
parameter counts.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import assert_folder_matches_hf, error_line, hf_saved, rewrite_config, run
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import opt, tensorfile

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             ffn_dim=24, max_position_embeddings=12, pad_token_id=1, bos_token_id=2,
             eos_token_id=2, word_embed_proj_dim=16)
TOKENS = [[2, 5, 9, 3, 7, 30, 11], [3, 3, 8, 39]]   # no 1: OPT's <pad>, whose row HF holds


def hf_opt_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "OPT", {**SMALL, **config}, dtype, seed)


def opt_as_is(model, cfg):
    """OPT needs no float64 patch: its positions are a table and its scores (under sdpa) are
    taken in the model's dtype."""
    return model


def opt_grads(model) -> dict:
    """An OPTForCausalLM's gradients under tfm's names; the position table's from row 2 on."""
    decoder = model.model.decoder
    theirs = {"embed.W_E": decoder.embed_tokens.weight.grad,
              "embed.W_pos": decoder.embed_positions.weight.grad[opt.OFFSET:]}
    if model.lm_head.weight is not decoder.embed_tokens.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    if decoder.final_layer_norm is not None:
        theirs["ln_f.gamma"] = decoder.final_layer_norm.weight.grad
        theirs["ln_f.beta"] = decoder.final_layer_norm.bias.grad
    for i, layer in enumerate(decoder.layers):
        p, attn = f"blocks.{i}.", layer.self_attn
        for ours, norm in (("ln1", layer.self_attn_layer_norm), ("ln2", layer.final_layer_norm)):
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (norm.weight.grad,
                                                                       norm.bias.grad)
        for ours, module in (("attn.W_Q", attn.q_proj), ("attn.W_K", attn.k_proj),
                             ("attn.W_V", attn.v_proj), ("attn.W_O", attn.out_proj),
                             ("ffn.W_1", layer.fc1), ("ffn.W_2", layer.fc2)):
            theirs[p + ours] = module.weight.grad.T
            if module.bias is not None:
                theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(norm="pre", tied_head=True, bias=True, activation="relu", n_ctx=12)),
    (dict(do_layer_norm_before=False, activation_function="gelu"),
     dict(norm="post", activation="gelu_erf")),
    (dict(tie_word_embeddings=False, enable_bias=False),
     dict(tied_head=False, bias=False)),
], ids=["opt-125m-like", "post-ln-exact-gelu", "untied-no-bias"])
def test_an_opt_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config, expect):
    state = hf_opt_folder(tmp_path, **config)
    fields = opt.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.pe, cfg.head_bias, cfg.rms_norm, cfg.eps) == ("learned", False, False, 1e-5)
    params = opt.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    np.testing.assert_array_equal(params["embed.W_pos"],
                                  state["model.decoder.embed_positions.weight"][2:])
    np.testing.assert_array_equal(params["blocks.1.ln2.beta"],
                                  state["model.decoder.layers.1.final_layer_norm.bias"])
    np.testing.assert_array_equal(params["blocks.0.attn.W_Q"],
                                  state["model.decoder.layers.0.self_attn.q_proj.weight"].T)
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("OPT checkpoint")
    assert_folder_matches_hf(transformers.OPTForCausalLM, tmp_path, loaded,
                             to_float64=opt_as_is, grads_of=opt_grads)


def test_a_folder_written_back_is_the_same_file_but_the_two_unread_rows(tmp_path):
    """``opt.from_tfm``: every stored tensor bit for bit, but the position table's rows 0 and
    1, which tfm does not read and writes as zeros."""
    from safetensors.numpy import load_file

    hf_opt_folder(tmp_path, "float32")
    fields = opt.read_config(tmp_path)
    back = opt.from_tfm(opt.load_params(tmp_path, fields, np.float64), fields)
    stored = load_file(tmp_path / "model.safetensors")
    assert sorted(back) == sorted(stored)
    for key, value in back.items():
        if key == "model.decoder.embed_positions.weight":
            assert not value[:2].any() and stored[key][:2].any()
            value, stored[key] = value[2:], stored[key][2:]
        np.testing.assert_array_equal(value, stored[key], err_msg=key)


def test_the_positions_run_out_where_opts_table_does(tmp_path):
    """12 learned positions: 12 tokens run, 13 are refused with the limit named."""
    hf_opt_folder(tmp_path, "float32")
    assert tfmcli.load(tmp_path, tokens=[list(range(2, 14))]).cfg.seq_len == 12
    line = error_line(run("forward", "--load", tmp_path, "--tokens",
                          ",".join(map(str, range(2, 15)))), 2)
    assert "12 learned positions" in line


@pytest.mark.parametrize("change, reason", [
    (dict(word_embed_proj_dim=8), "key 'word_embed_proj_dim' is 8; OPT projects its 16-wide "
     "blocks to that width and back (project_in, project_out), which tfm does not"),
    (dict(layer_norm_elementwise_affine=False), "key 'layer_norm_elementwise_affine' is false; "
     "tfm's layer norms have a gamma and a beta"),
    (dict(_remove_final_layer_norm=True), "key '_remove_final_layer_norm' is true; tfm's Pre-LN "
     "model ends with ln_f"),
    (dict(activation_function="silu"), "key 'activation_function' is 'silu'; tfm reads 'gelu', "
     "'gelu_new', 'gelu_pytorch_tanh', 'relu'"),
    (dict(enable_bias="yes"), "key 'enable_bias' is 'yes', not true or false"),
], ids=["projection", "no-affine", "no-final-norm", "silu", "bias-text"])
def test_an_opt_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_opt_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "2,3,4"), 1)
    assert line.endswith(reason) and "config.json" in line


def test_a_position_table_of_the_wrong_length_is_named(tmp_path):
    """The table must hold the context and the two rows before it: 14 rows for 12 positions."""
    hf_opt_folder(tmp_path, "float32")
    fields = opt.read_config(tmp_path)
    tensors = opt.from_tfm(opt.load_params(tmp_path, fields, np.float32), fields)
    key = "model.decoder.embed_positions.weight"
    tensors[key] = tensors[key][2:]
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    assert error_line(run("forward", "--load", tmp_path, "--tokens", "2,3,4"), 1).endswith(
        f"key '{key}' has shape (12, 16), but config.json says (14, 16)")


def test_opt_125m_and_1_3b_have_their_parameter_counts():
    """facebook/opt-125m's and opt-1.3b's sizes: Hugging Face's OPTForCausalLM counts
    125,239,296 and 1,315,758,080 on the meta device, two position rows (2 d) more than tfm,
    which does not hold the table's first two rows."""
    for count, (d, H, L) in {125_239_296: (768, 12, 12), 1_315_758_080: (2048, 32, 24)}.items():
        cfg = tfmcli.Config(d_model=d, heads=H, layers=L, vocab=50272, pe="learned", n_ctx=2048,
                            seq_len=1, activation="relu", tied_head=True, head_bias=False)
        assert param_count(cfg) == count - 2 * d
