"""Gemma checkpoint folders (``"model_type": "gemma"``) and the model they make: GeGLU, the
embedding times sqrt(d), a tied head, heads 256 wide (here 6) with one key head, and norms
that multiply by ``1 + weight``. The model at random O(1) parameters against Hugging Face's
GemmaForCausalLM (loss, logits and every gradient to 1e-12); folders that ``save_pretrained``
writes, read to the bit and run against ``from_pretrained``; the refusals; the counts of Gemma
2B and 7B.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_folder_matches_hf,
    assert_gemma_weights_read_to_the_bit,
    assert_grads_match,
    error_line,
    float64_gemma,
    gemma_holding,
    hf_logits,
    hf_saved,
    llama_grads,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import gemma

GEMMA = dict(pe="rope", activation="geglu", rms_norm=True, head_bias=False, bias=False,
             embed_scale=True, tied_head=True)


def gemma_cfg(**fields):
    """Gemma's shape, small: 4 heads 6 wide on a width of 16 (sqrt(16) = 4 exactly, as Hugging
    Face's float32 scale is), one key head, a padded row."""
    base = dict(d_model=16, heads=4, kv_heads=1, head_dim=6, seq_len=6, lengths=(6, 4),
                d_ff=12, eps=1e-6, **GEMMA)
    return tfmcli.Config(**{**base, **fields})


def gemma_from(params, cfg):
    """Hugging Face's GemmaForCausalLM holding tfm's parameters in float64
    (``gemma_holding``, torch's own attention kernel)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GemmaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.h_kv, head_dim=cfg.d_head,
        intermediate_size=cfg.ff, hidden_act="gelu_pytorch_tanh", max_position_embeddings=64,
        rms_norm_eps=cfg.eps, tie_word_embeddings=cfg.tied_head, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    return gemma_holding(transformers.GemmaForCausalLM, config, params, cfg, attention="sdpa")


# ---------------------------------------------------------------- sizes


def test_gemma_2b_and_7b_have_their_parameter_counts():
    """google/gemma-2b's and gemma-7b's sizes (their config.json): the counts Hugging Face's
    GemmaForCausalLM gives the same configs on the meta device (the tied embedding once)."""
    two = tfmcli.Config(d_model=2048, heads=8, kv_heads=1, head_dim=256, layers=18, d_ff=16384,
                        vocab=256000, **GEMMA)
    seven = tfmcli.Config(d_model=3072, heads=16, head_dim=256, layers=28, d_ff=24576,
                          vocab=256000, **GEMMA)
    assert param_count(two) == 2_506_172_416
    assert param_count(seven) == 8_537_680_896
    assert seven.d_q == 4096 != seven.d_model   # 16 heads of 256 on a width of 3072


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [dict(), dict(tied_head=False, kv_heads=2, layers=1),
                                    dict(heads=2, kv_heads=2, head_dim=None, rope_theta=500.0)],
                         ids=["tied-mqa-L2", "untied-gqa", "mha-d-over-H"])
def test_matches_hugging_face(fields):
    """GemmaForCausalLM holding tfm's random parameters (every gamma drawn, so every norm
    weight gamma - 1 is too): loss, logits and every gradient, a padded row included."""
    pytest.importorskip("torch")
    cfg = gemma_cfg(**{"layers": 2, **fields})
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = gemma_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)   # the same module names; d weight = d gamma
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_the_three_differences_each_move_the_loss():
    """Without the scale, with silu for GELU, or with the gammas read as the stored weights
    (no 1 added), Hugging Face's loss is missed: each is needed."""
    cfg = gemma_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    model = gemma_from(params, cfg)
    logits, keys = hf_logits(model, inputs, cfg)
    ours = tfmcli.forward(params, inputs, cfg).acts["logits"]
    assert np.abs(ours - logits)[keys].max() < 1e-12
    offsets = {n: v - 1.0 if n.endswith(".gamma") else v for n, v in params.items()}
    for wrong_cfg, wrong_params in ((cfg.replace(embed_scale=False), params),
                                    (cfg.replace(activation="swiglu"), params),
                                    (cfg, offsets)):
        wrong = tfmcli.forward(wrong_params, inputs, wrong_cfg).acts["logits"]
        assert np.abs(wrong - logits)[keys].max() > 1e-2


# ---------------------------------------------------------------- checkpoint folders


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=6, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6, pad_token_id=None)


def hf_gemma_folder(folder, dtype="bfloat16", seed=0, **config):
    """A random GemmaForCausalLM saved by ``save_pretrained`` (``helpers.hf_saved``: its norm
    weights drawn about 1, so its gammas about 2)."""
    return hf_saved(folder, "Gemma", {**SMALL, **config}, dtype, seed)


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False)],
                         ids=["tied", "untied"])
def test_a_gemma_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config):
    state = hf_gemma_folder(tmp_path, **config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma"
    fields = gemma.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.activation, cfg.embed_scale, cfg.tied_head, cfg.h_kv, cfg.d_head) == (
        "geglu", True, config.get("tie_word_embeddings", True), 1, 6)
    params = gemma.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    assert_gemma_weights_read_to_the_bit(params, state, fields)
    transformers = pytest.importorskip("transformers")
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Gemma checkpoint")
    assert_folder_matches_hf(transformers.GemmaForCausalLM, tmp_path, run_, float64_gemma)


def test_float32_gammas_are_added_as_gemma_adds_them(tmp_path):
    """In float32 the gamma is float32(1 + weight), the sum Hugging Face's GemmaRMSNorm makes
    in float32; and writing the folder back gives the stored weights."""
    state = hf_gemma_folder(tmp_path, "float32")
    fields = gemma.read_config(tmp_path)
    params = gemma.load_params(tmp_path, fields, np.float32)
    weight = state["model.norm.weight"].astype(np.float32)
    assert params["ln_f.gamma"].dtype == np.float32
    np.testing.assert_array_equal(params["ln_f.gamma"], np.float32(1.0) + weight)
    back = gemma.from_tfm({n: v.astype(np.float64) for n, v in
                           gemma.load_params(tmp_path, fields, np.float64).items()}, fields)
    for key, value in back.items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)


def test_a_gemma_config_without_head_dim_or_tying_takes_gemmas_defaults(tmp_path):
    hf_gemma_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("head_dim", "tie_word_embeddings", "hidden_act"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields = gemma.read_config(tmp_path)
    assert (fields["head_dim"], fields["tied_head"], fields["activation"]) == (256, True, "geglu")


def test_the_first_configs_gelu_is_read_as_its_tanh_form(tmp_path):
    """google/gemma-2b's config.json says hidden_act 'gelu' and hidden_activation
    'gelu_pytorch_tanh'; Hugging Face runs the tanh form, and so does tfm."""
    hf_gemma_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert gemma.read_config(tmp_path)["activation"] == "geglu"


@pytest.mark.parametrize("change, reason", [
    (dict(hidden_act="relu"),
     "key 'hidden_act' is 'relu'; tfm's Gemma FFN is GeGLU with GELU's tanh form "
     "('gelu_pytorch_tanh')"),
    (dict(hidden_activation="silu"),
     "key 'hidden_activation' is 'silu'; tfm's Gemma FFN is GeGLU with GELU's tanh form "
     "('gelu_pytorch_tanh')"),
    (dict(attention_bias=True),
     "key 'attention_bias' is True; tfm adds biases to all of attention and the FFN (--bias) or "
     "to Q, K and V alone (--qkv-bias), and a Gemma's would be on o_proj too and not in the MLP"),
    (dict(use_bidirectional_attention=True),
     "key 'use_bidirectional_attention' is True; tfm reads Gemma as the causal language model "
     "it is trained as"),
], ids=["relu", "silu", "attention-bias", "bidirectional"])
def test_a_gemma_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_gemma_folder(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith(reason) and "config.json" in line


def test_the_views_read_a_gemma_folder(tmp_path):
    """The panel names the checkpoint and its three differences; tfm ffn lays out gelu(gate)
    from the folder's weights; tfm embed multiplies by sqrt(16) = 4."""
    hf_gemma_folder(tmp_path, "float32")
    text = ok("forward", "--load", tmp_path, "--tokens", "1,5,9,2").stdout
    assert "Gemma checkpoint" in text
    assert "geglu (gelu(gate) * pre, tanh approx.)" in text
    assert "x sqrt(d) = 4 (embed = sqrt(d) W_E[id])" in text
    assert "h W_E^T (tied to the embedding)" in text
    data = json.loads(ok("ffn", "--load", tmp_path, "--tokens", "1,5,9,2", "-t", 2,
                         "--json").stdout)
    assert data["activation"] == "geglu" and data["dx_numeric_diff"] < 1e-6
    embed = json.loads(ok("embed", "--load", tmp_path, "--tokens", "1,5,9,2", "-t", 1,
                          "--json").stdout)
    assert embed["scale"] == 4.0 and embed["forward_model_diff"] == 0.0


# ---------------------------------------------------------------- the shipped example

EXAMPLE = Path(__file__).parent.parent / "examples" / "tiny-gemma"


def test_the_example_matches_hugging_face_and_its_tokenizer():
    """examples/tiny-gemma read by Hugging Face's GemmaForCausalLM.from_pretrained: the same
    loss, logits and gradients on a text its tokenizer starts with '<s>', the ids transformers'
    own tokenizer gives."""
    transformers = pytest.importorskip("transformers")
    text = "The dog saw the cat."
    run_ = tfmcli.load(EXAMPLE, text=text)
    assert (run_.cfg.activation, run_.cfg.embed_scale, run_.cfg.tied_head, run_.cfg.h_kv,
            run_.cfg.d_q) == ("geglu", True, True, 1, 64)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(EXAMPLE / "tokenizer.json"))
    assert run_.inputs.tokens[0].tolist() == theirs(text)["input_ids"]
    model = float64_gemma(transformers.GemmaForCausalLM.from_pretrained(
        EXAMPLE, attn_implementation="sdpa").double().eval(), run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    # Trained, block 1's attention is all but one-hot on this text: its W_Q's gradient is 0
    # but for rounding (1e-17 in Hugging Face's, 1e-29 in tfm's), so each gradient is held to
    # 1e-12 of the largest of all, not of its own.
    theirs = llama_grads(model)
    largest = max(np.abs(grad).max() for grad in theirs.values())
    assert np.abs(theirs["blocks.1.attn.W_Q"]).max() < 1e-15 * largest
    for name, grad in theirs.items():
        np.testing.assert_allclose(grads[name], grad, rtol=0, atol=1e-12 * largest, err_msg=name)
    assert np.abs(grads["blocks.0.attn.W_Q"] - theirs["blocks.0.attn.W_Q"]).max() < 1e-12 * (
        np.abs(theirs["blocks.0.attn.W_Q"]).max())   # where it is not 0, to its own scale


def test_a_tied_heads_lens_reads_each_token_back_at_the_embedding():
    """At the embedding, before any block, the tied head scores each position's own row of
    W_E against every row: its own wins, so the lens's first row predicts the input token
    itself (the README's example)."""
    from tfmcli.explain.lens import logit_lens

    run_ = tfmcli.load(EXAMPLE, text="The dog saw the cat.")
    fwd = tfmcli.forward(run_.params, run_.inputs, run_.cfg)
    embed = logit_lens(run_.params, fwd, run_.cfg, 0, 1)[0]
    assert embed.top[:, 0].tolist() == run_.inputs.tokens[0].tolist()
