"""BLOOM checkpoint folders (``"model_type": "bloom"``): ALiBi, a norm of the embedding, q, k
and v in one ``query_key_value``. Folders that Hugging Face's ``save_pretrained`` writes from a
random BloomForCausalLM, read and run against its ``from_pretrained``; BigScience's names
without ``transformer.``; written back; the refusal; bloom-560m's parameter count.
"""

from __future__ import annotations

import math

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
    unpatched_logits_off,
)
from tfmcli.engine.positional import alibi_slopes
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import bloom

SMALL = dict(vocab_size=40, hidden_size=16, n_layer=2, n_head=4, bos_token_id=1,
             eos_token_id=2)   # d_head 4
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_bloom_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "Bloom", {**SMALL, **config}, dtype, seed)


@pytest.fixture
def bloom_in_float64(monkeypatch):
    """Hugging Face's BLOOM computes its softmax in float32 whatever the model's dtype, and
    writes GELU's sqrt(2 / pi) as 0.79788456, in its forward and in the backward it writes by
    hand (``GeLUFunction``): with both lifted (the softmax in the scores' dtype, GELU's tanh
    form with the exact constant, through autograd) its float64 model is tfm's to rounding."""
    torch = pytest.importorskip("torch")
    from transformers.models.bloom import modeling_bloom

    class Functional:   # torch.nn.functional with a softmax that keeps its input's dtype
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def softmax(x, dim=-1, dtype=None):
            return torch.softmax(x, dim=dim)

    monkeypatch.setattr(modeling_bloom, "F", Functional())
    monkeypatch.setattr(modeling_bloom.BloomGelu, "forward", lambda self, x: x * 0.5 * (
        1.0 + torch.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x))))
    return lambda model, cfg: model


def bloom_grads(model) -> dict:
    """A BloomForCausalLM's gradients under tfm's names: ``query_key_value``'s rows cut as its
    attention cuts them (``view(..., heads, 3, d_head)``: each head's q, k, v)."""
    tr, cfg = model.transformer, model.config
    d, H = cfg.hidden_size, cfg.n_head
    dh = d // H
    theirs = {"embed.W_E": tr.word_embeddings.weight.grad,
              "ln_embed.gamma": tr.word_embeddings_layernorm.weight.grad,
              "ln_embed.beta": tr.word_embeddings_layernorm.bias.grad,
              "ln_f.gamma": tr.ln_f.weight.grad, "ln_f.beta": tr.ln_f.bias.grad}
    if model.lm_head.weight is not tr.word_embeddings.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(tr.h):
        p, attn = f"blocks.{i}.", layer.self_attention
        for ours, norm in (("ln1", layer.input_layernorm), ("ln2", layer.post_attention_layernorm)):
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (norm.weight.grad,
                                                                       norm.bias.grad)
        w3 = attn.query_key_value.weight.grad.reshape(H, 3, dh, d)
        b3 = attn.query_key_value.bias.grad.reshape(H, 3, dh)
        for j, x in enumerate("QKV"):
            theirs[p + f"attn.W_{x}"] = w3[:, j].reshape(d, d).T
            theirs[p + f"attn.b_{x}"] = b3[:, j].reshape(d)
        for ours, module in (("attn.W_O", attn.dense), ("ffn.W_1", layer.mlp.dense_h_to_4h),
                             ("ffn.W_2", layer.mlp.dense_4h_to_h)):
            theirs[p + ours] = module.weight.grad.T
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False, n_head=2),
                                    dict(n_head=8, layer_norm_epsilon=1e-3)],
                         ids=["tied", "untied-two-heads", "eight-heads-eps"])
def test_a_bloom_folder_is_read_and_matches_from_pretrained(tmp_path, config, bloom_in_float64):
    state = hf_bloom_folder(tmp_path, **config)
    fields = bloom.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.pe, cfg.embed_norm, cfg.activation, cfg.norm, cfg.bias, cfg.head_bias) == (
        "alibi", True, "gelu", "pre", True, False)
    assert cfg.tied_head == config.get("tie_word_embeddings", True)
    assert cfg.eps == config.get("layer_norm_epsilon", 1e-5) and cfg.ff == 4 * 16
    params = bloom.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    # query_key_value's rows: head 1's q, k, v are rows 3 d_head .. 6 d_head
    dh = 16 // cfg.heads
    qkv = state["transformer.h.1.self_attention.query_key_value.weight"]
    np.testing.assert_array_equal(params["blocks.1.attn.W_K"][:, dh:2 * dh],
                                  qkv[4 * dh:5 * dh].T)
    np.testing.assert_array_equal(params["ln_embed.beta"],
                                  state["transformer.word_embeddings_layernorm.bias"])
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("BLOOM checkpoint")
    assert_folder_matches_hf(transformers.BloomForCausalLM, tmp_path, loaded,
                             to_float64=bloom_in_float64, grads_of=bloom_grads, attention=None)


def test_unpatched_bloom_agrees_to_float32s_softmax(tmp_path):
    """Without the patches Hugging Face's float64 BLOOM differs from tfm's by its float32
    softmax and its GELU constant: more than rounding, well under 1e-5."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_bloom_folder(tmp_path)
    assert 1e-12 < unpatched_logits_off(transformers.BloomForCausalLM, tmp_path, TOKENS) < 1e-5


def test_the_slopes_are_hugging_faces():
    torch = pytest.importorskip("torch")
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for heads in range(1, 25):   # float32 powers there: a float32 step or two off
        theirs = _get_alibi_slopes(heads, torch.device("cpu")).double().numpy()
        np.testing.assert_allclose(theirs, alibi_slopes(heads), rtol=3e-7, atol=0)
        exact = np.array_equal(theirs, alibi_slopes(heads))
        assert exact == (heads <= 8), heads   # the docs' claim: exact up to 8 heads, not after
    # 16 heads (bloom-560m's): the base 2^-0.5 rounded, its square is not 1/2
    assert _get_alibi_slopes(16, torch.device("cpu"))[1].item() == 0.4999999701976776


def test_bigscience_names_without_the_prefix_are_read(tmp_path):
    """BigScience's own files name the weights ``h.0...``, ``word_embeddings...``: the same
    parameters come out."""
    from tfmcli.sources import tensorfile

    hf_bloom_folder(tmp_path, "float32")
    fields = bloom.read_config(tmp_path)
    params = bloom.load_params(tmp_path, fields, np.float64)
    tensors = bloom.from_tfm(params, fields)
    tensorfile.write(tmp_path / "model.safetensors",
                     {key.removeprefix("transformer."): value for key, value in tensors.items()})
    again = bloom.load_params(tmp_path, fields, np.float64)
    assert list(again) == list(params)
    for name in params:
        np.testing.assert_array_equal(again[name], params[name], err_msg=name)


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False)],
                         ids=["tied", "untied"])
def test_a_folder_written_back_is_the_same_file(tmp_path, config):
    hf_bloom_folder(tmp_path, "float32", **config)
    assert_written_back(bloom, tmp_path)


def test_the_residual_after_the_norm_is_refused(tmp_path):
    hf_bloom_folder(tmp_path, "float32")
    rewrite_config(tmp_path, apply_residual_connection_post_layernorm=True)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "config.json" in line and line.endswith(
        "key 'apply_residual_connection_post_layernorm' is true (each residual taken after its "
        "norm), which tfm's blocks do not do")


def test_bloom_560m_has_its_parameter_count():
    """bigscience/bloom-560m's size (d 1024, 16 heads, 24 blocks, 250,880 tokens, the head
    tied): 559,214,592, the count Hugging Face's BloomForCausalLM gives its config on the meta
    device."""
    cfg = tfmcli.Config(d_model=1024, heads=16, layers=24, vocab=250880, pe="alibi",
                        embed_norm=True, seq_len=1, activation="gelu", tied_head=True,
                        head_bias=False)
    assert param_count(cfg) == 559_214_592


@pytest.mark.parametrize("tp, slow, refused", [(2, True, True), (2, False, False),
                                               (1, True, False)])
def test_the_slow_path_that_drops_two_biases_is_refused(tmp_path, tp, slow, refused):
    """Issue 59: with pretraining_tp > 1 and slow_but_exact true, Hugging Face's slow path
    leaves out the biases of self_attention.dense and mlp.dense_4h_to_h (logits 0.4 apart from
    its fast path, which tfm computes); tfm ran such a folder silently."""
    hf_bloom_folder(tmp_path, "float32")
    rewrite_config(tmp_path, pretraining_tp=tp, slow_but_exact=slow)
    result = run("forward", "--load", tmp_path, "--tokens", "1,2,3")
    if refused:
        assert error_line(result, 1).endswith(
            "key 'slow_but_exact' is true with pretraining_tp 2: Hugging Face's slow path then "
            "leaves out the biases of self_attention.dense and mlp.dense_4h_to_h, which its fast "
            "path (and tfm) adds; the two readings disagree, so tfm runs neither")
    else:
        assert result.exit_code == 0, result.output
