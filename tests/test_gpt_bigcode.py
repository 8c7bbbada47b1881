"""GPTBigCode checkpoint folders (``"model_type": "gpt_bigcode"``: SantaCoder, StarCoder): GPT-2's
model with one key and value head, q, k and v in one ``c_attn``. Folders that Hugging Face's
``save_pretrained`` writes from a random GPTBigCodeForCausalLM, read and run against its
``from_pretrained``; written back; the refusal; tiny_starcoder's parameter count.
"""

from __future__ import annotations

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
from tfmcli.sources import gpt_bigcode

SMALL = dict(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=12, bos_token_id=1,
             eos_token_id=2)   # d_head 4
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_bigcode_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "GPTBigCode", {**SMALL, **config}, dtype, seed)


def as_is(model, cfg):
    """GPTBigCode needs no float64 patch under sdpa: learned positions, scores in its dtype."""
    return model


def bigcode_grads(model) -> dict:
    """A GPTBigCodeForCausalLM's gradients under tfm's names: ``c_attn``'s rows cut as its
    attention cuts them (multi-query: the queries, the key, the value; else head by head)."""
    tr, cfg = model.transformer, model.config
    d, H = cfg.n_embd, cfg.n_head
    dh = d // H
    theirs = {"embed.W_E": tr.wte.weight.grad, "embed.W_pos": tr.wpe.weight.grad,
              "ln_f.gamma": tr.ln_f.weight.grad, "ln_f.beta": tr.ln_f.bias.grad}
    if model.lm_head.weight is not tr.wte.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(tr.h):
        p, attn = f"blocks.{i}.", layer.attn
        for ours, norm in (("ln1", layer.ln_1), ("ln2", layer.ln_2)):
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (norm.weight.grad,
                                                                       norm.bias.grad)
        w, b = attn.c_attn.weight.grad, attn.c_attn.bias.grad
        if cfg.multi_query:
            parts = {"Q": (w[:d], b[:d]), "K": (w[d:d + dh], b[d:d + dh]),
                     "V": (w[d + dh:], b[d + dh:])}
        else:
            w3, b3 = w.reshape(H, 3, dh, d), b.reshape(H, 3, dh)
            parts = {x: (w3[:, j].reshape(d, d), b3[:, j].reshape(d))
                     for j, x in enumerate("QKV")}
        for x, (weight, bias) in parts.items():
            theirs[p + f"attn.W_{x}"], theirs[p + f"attn.b_{x}"] = weight.T, bias
        for ours, module in (("attn.W_O", attn.c_proj), ("ffn.W_1", layer.mlp.c_fc),
                             ("ffn.W_2", layer.mlp.c_proj)):
            theirs[p + ours] = module.weight.grad.T
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(kv_heads=1, tied_head=True, activation="gelu", attn_scale=None, n_ctx=12)),
    (dict(multi_query=False, tie_word_embeddings=False, activation_function="gelu",
          n_inner=24),
     dict(kv_heads=None, tied_head=False, activation="gelu_erf", d_ff=24)),
    (dict(scale_attn_weights=False, activation_function="relu"),
     dict(attn_scale=1.0, activation="relu")),
], ids=["santacoder-like", "a-key-head-each-untied", "unscaled-relu"])
def test_a_bigcode_folder_is_read_and_matches_from_pretrained(tmp_path, config, expect):
    state = hf_bigcode_folder(tmp_path, **config)
    fields = gpt_bigcode.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.pe, cfg.norm, cfg.bias, cfg.head_bias) == ("learned", "pre", True, False)
    params = gpt_bigcode.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    np.testing.assert_array_equal(params["embed.W_pos"], state["transformer.wpe.weight"])
    if cfg.h_kv == 1:   # c_attn's rows: the 16 queries', then the key's 4, the value's 4
        c_attn = state["transformer.h.1.attn.c_attn.weight"]
        np.testing.assert_array_equal(params["blocks.1.attn.W_K"], c_attn[16:20].T)
        np.testing.assert_array_equal(params["blocks.1.attn.b_V"],
                                      state["transformer.h.1.attn.c_attn.bias"][20:])
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("GPTBigCode checkpoint")
    assert_folder_matches_hf(transformers.GPTBigCodeForCausalLM, tmp_path, loaded,
                             to_float64=as_is, grads_of=bigcode_grads)


@pytest.mark.parametrize("config", [dict(), dict(multi_query=False)], ids=["mqa", "mha"])
def test_a_folder_written_back_is_the_same_file(tmp_path, config):
    hf_bigcode_folder(tmp_path, "float32", **config)
    assert_written_back(gpt_bigcode, tmp_path)


def test_cross_attention_is_refused(tmp_path):
    hf_bigcode_folder(tmp_path, "float32")
    rewrite_config(tmp_path, add_cross_attention=True)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "config.json" in line and line.endswith(
        "key 'add_cross_attention' is true (attention to an encoder's states), which tfm's "
        "decoder does not have")


def test_tiny_starcoder_has_its_parameter_count():
    """bigcode/tiny_starcoder_py's size (d 768, 12 heads, 20 blocks, 8,192 positions, 49,152
    tokens): 164,144,128, the count Hugging Face's GPTBigCodeForCausalLM gives its config on
    the meta device."""
    cfg = tfmcli.Config(d_model=768, heads=12, kv_heads=1, layers=20, vocab=49152,
                        pe="learned", n_ctx=8192, seq_len=1, activation="gelu",
                        tied_head=True, head_bias=False)
    assert param_count(cfg) == 164_144_128
