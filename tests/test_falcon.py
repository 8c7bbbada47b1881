"""Falcon checkpoint folders (``"model_type": "falcon"``): Falcon-7B's block (attention and the
MLP side by side on one norm, one key head), the new architecture's (a norm each, grouped keys;
or one norm, Falcon 2's), and the sequential one; q, k and v in one ``query_key_value`` of one
piece per key head. Folders that Hugging Face's ``save_pretrained`` writes from a random
FalconForCausalLM, read and run against its ``from_pretrained``; written back; the refusals;
Falcon-7B's parameter count.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_folder_matches_hf,
    assert_written_back,
    error_line,
    float64_rotary,
    hf_saved,
    rewrite_config,
    run,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import falcon, fused

SMALL = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=32, bos_token_id=1, eos_token_id=2)   # d_head 8
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_falcon_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "Falcon", {**SMALL, **config}, dtype, seed)


def falcon_in_float64(model, cfg):
    """Falcon's RoPE tables made in float64 (it makes them in float32)."""
    float64_rotary(model.transformer.rotary_emb, cfg.rope_width, cfg.rope_theta,
                   cfg.rope_scaling)
    return model


def split_qkv(matrix, heads: int, kv: int, dh: int) -> dict:
    """Hugging Face's own cut of ``query_key_value`` (``FalconAttention._split_heads``): one
    piece per key head, its query heads, then its key, then its value."""
    pieces = matrix.reshape(kv, heads // kv + 2, dh, *matrix.shape[1:])
    rest = matrix.shape[1:]
    return {"Q": pieces[:, :-2].reshape(heads * dh, *rest),
            "K": pieces[:, -2].reshape(kv * dh, *rest), "V": pieces[:, -1].reshape(kv * dh, *rest)}


def falcon_grads(model, cfg) -> dict:
    """A FalconForCausalLM's gradients under tfm's names."""
    tr = model.transformer
    theirs = {"embed.W_E": tr.word_embeddings.weight.grad, "ln_f.gamma": tr.ln_f.weight.grad,
              "ln_f.beta": tr.ln_f.bias.grad}
    if model.lm_head.weight is not tr.word_embeddings.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(tr.h):
        p, attn = f"blocks.{i}.", layer.self_attention
        norms = ([("ln1", layer.ln_attn), ("ln2", layer.ln_mlp)] if hasattr(layer, "ln_attn")
                 else [("ln1", layer.input_layernorm)]
                 + ([("ln2", layer.post_attention_layernorm)]
                    if hasattr(layer, "post_attention_layernorm") else []))
        for ours, norm in norms:
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (norm.weight.grad,
                                                                       norm.bias.grad)
        qkv = split_qkv(attn.query_key_value.weight.grad, cfg.heads, cfg.h_kv, cfg.d_head)
        theirs.update({p + f"attn.W_{w}": qkv[w].T for w in "QKV"})
        if attn.query_key_value.bias is not None:
            qkv_b = split_qkv(attn.query_key_value.bias.grad, cfg.heads, cfg.h_kv, cfg.d_head)
            theirs.update({p + f"attn.b_{w}": qkv_b[w] for w in "QKV"})
        for ours, module in (("attn.W_O", attn.dense), ("ffn.W_1", layer.mlp.dense_h_to_4h),
                             ("ffn.W_2", layer.mlp.dense_4h_to_h)):
            theirs[p + ours] = module.weight.grad.T
            if module.bias is not None:
                theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


def test_query_key_value_rows_are_cut_one_piece_per_key_head():
    """4 heads of width 1, 2 key heads: pieces of 4 rows, (q, q, k, v)."""
    fields = dict(d_model=4, heads=4, kv_heads=2, pe="rope")
    q, k, v = fused.grouped_rows(fields)
    assert (q.tolist(), k.tolist(), v.tolist()) == ([0, 1, 4, 5], [2, 6], [3, 7])
    q, k, v = fused.grouped_rows(dict(d_model=4, heads=2, kv_heads=1, pe="rope"))   # multi-query
    assert (q.tolist(), k.tolist(), v.tolist()) == ([0, 1, 2, 3], [4, 5], [6, 7])
    q, k, v = fused.grouped_rows(dict(d_model=4, heads=2, pe="rope"))   # a key head each
    assert (q.tolist(), k.tolist(), v.tolist()) == ([0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11])


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(kv_heads=1, parallel_residual=True, shared_norm=True, bias=False,
                  tied_head=True, activation="gelu_erf")),
    (dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False),
     dict(kv_heads=2, parallel_residual=True, shared_norm=False, bias=True, tied_head=False)),
    (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
          rope_theta=500.0),
     dict(kv_heads=2, parallel_residual=True, shared_norm=True, rope_theta=500.0)),
    (dict(multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=48),
     dict(kv_heads=None, parallel_residual=False, shared_norm=False, d_ff=48)),
], ids=["falcon-7b-like", "falcon-40b-like", "falcon-2-like", "sequential-biases"])
def test_a_falcon_folder_is_read_and_matches_from_pretrained(tmp_path, config, expect):
    state = hf_falcon_folder(tmp_path, **config)
    fields = falcon.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.pe, cfg.rms_norm, cfg.head_bias, cfg.rotary_dim) == ("rope", False, False, None)
    params = falcon.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    qkv = split_qkv(state["transformer.h.1.self_attention.query_key_value.weight"], 4, cfg.h_kv,
                    8)
    for w in "QKV":
        np.testing.assert_array_equal(params[f"blocks.1.attn.W_{w}"], qkv[w].T)
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("Falcon checkpoint")
    assert_folder_matches_hf(transformers.FalconForCausalLM, tmp_path, loaded,
                             to_float64=falcon_in_float64,
                             grads_of=lambda model: falcon_grads(model, cfg))


@pytest.mark.parametrize("config", [dict(), dict(new_decoder_architecture=True, num_kv_heads=2,
                                                 bias=True)],
                         ids=["multi-query", "grouped-biases"])
def test_a_folder_written_back_is_the_same_file(tmp_path, config):
    hf_falcon_folder(tmp_path, "float32", **config)
    assert_written_back(falcon, tmp_path)


@pytest.mark.parametrize("change, reason", [
    (dict(alibi=True), "key 'alibi' is true (Falcon-RW's ALiBi positions, a slope a head added "
     "to the scores), which tfm does not compute"),
    (dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1, parallel_attn=False),
     "key 'parallel_attn' is false with the new architecture's one norm, a block Hugging "
     "Face's Falcon does not run"),
    (dict(activation="silu"), "key 'activation' is 'silu'; tfm reads 'gelu', 'gelu_new', "
     "'gelu_pytorch_tanh', 'relu'"),
    (dict(multi_query="no"), "key 'multi_query' is 'no', not true or false"),
], ids=["alibi", "one-norm-sequential", "silu", "multi-query-text"])
def test_a_falcon_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_falcon_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


def test_falcon_7b_has_its_parameter_count():
    """tiiuae/falcon-7b's size: 6,921,720,704, the count Hugging Face's FalconForCausalLM
    gives its config (FalconConfig's defaults) on the meta device."""
    cfg = tfmcli.Config(d_model=4544, heads=71, kv_heads=1, layers=32, vocab=65024, pe="rope",
                        activation="gelu_erf", parallel_residual=True, shared_norm=True,
                        bias=False, tied_head=True, head_bias=False)
    assert param_count(cfg) == 6_921_720_704
