"""GPT-J checkpoint folders (``"model_type": "gptj"``): one layer norm a block read by attention and
the MLP side by side (``--parallel-residual --shared-norm``), no biases in attention and biases
in the MLP and the head (``--no-bias --ffn-bias``), RoPE on each head's first ``rotary_dim``
dimensions turned in neighbouring pairs, which the reader moves to tfm's halves. Folders that
Hugging Face's ``save_pretrained`` writes from a random GPTJForCausalLM, read to the bit and run
against its ``from_pretrained``; the refusals; GPT-J-6B's parameter count.
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
    gptj_in_float64,
    gptj_scores_in_float64,
    hf_logits,
    hf_saved,
    rewrite_config,
    run,
    tfm_grads_matching_hf,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import gptj

SMALL = dict(vocab_size=40, n_embd=24, n_layer=2, n_head=2, rotary_dim=4, n_inner=32,
             n_positions=32, bos_token_id=1, eos_token_id=2)   # d_head 12: 4 turned
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_gptj_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "GPTJ", {**SMALL, **config}, dtype, seed)


def gptj_grads(model) -> dict:
    """A GPTJForCausalLM's gradients under tfm's names, W_Q's and W_K's columns in tfm's
    order."""
    fields = {"d_model": model.config.n_embd, "heads": model.config.n_head,
              "pe": "rope", "rotary_dim": model.config.rotary_dim}
    order = gptj.interleaved_order(fields)
    theirs = {"embed.W_E": model.transformer.wte.weight.grad,
              "ln_f.gamma": model.transformer.ln_f.weight.grad,
              "ln_f.beta": model.transformer.ln_f.bias.grad,
              "head.b_U": model.lm_head.bias.grad}
    if model.lm_head.weight is not model.transformer.wte.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(model.transformer.h):
        p, attn, mlp = f"blocks.{i}.", layer.attn, layer.mlp
        theirs[p + "ln1.gamma"] = layer.ln_1.weight.grad
        theirs[p + "ln1.beta"] = layer.ln_1.bias.grad
        theirs[p + "attn.W_Q"] = attn.q_proj.weight.grad.T[:, order]
        theirs[p + "attn.W_K"] = attn.k_proj.weight.grad.T[:, order]
        theirs[p + "attn.W_V"] = attn.v_proj.weight.grad.T
        theirs[p + "attn.W_O"] = attn.out_proj.weight.grad.T
        for ours, module in (("ffn.W_1", mlp.fc_in), ("ffn.W_2", mlp.fc_out)):
            theirs[p + ours] = module.weight.grad.T
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


def softmax_cancellation(fwd, grads, block: int) -> float:
    """How many times larger the terms of a block's softmax backward, dscores = p (dp - sum p
    dp), are than the dscores they add up to. Each is rounded at its own size, so a saturated
    softmax (p near one-hot: the terms cancel) leaves dscores, and the gradients reached only
    through it, with rounding this many times their own scale's."""
    p = fwd.acts[f"blocks.{block}.attn.pattern"]                   # (B, H, T, T)
    dp = grads.acts[f"blocks.{block}.attn.pattern"]                # (B, H, T, T)
    terms = np.abs(p * dp) + p * (p * np.abs(dp)).sum(-1, keepdims=True)
    return float(terms.max() / np.abs(grads.acts[f"blocks.{block}.attn.scores"]).max())


def test_neighbouring_pairs_are_moved_to_tfms_halves():
    """Each head's turned columns: GPT-J's even ones, then its odd ones, then the rest; so
    GPT-J's pair (2i, 2i + 1) is tfm's (i, i + rotary_dim / 2)."""
    fields = dict(d_model=12, heads=2, pe="rope", rotary_dim=4)
    assert gptj.interleaved_order(fields).tolist() == [0, 2, 1, 3, 4, 5, 6, 8, 7, 9, 10, 11]
    whole = gptj.interleaved_order(dict(d_model=8, heads=2, pe="rope"))
    assert whole.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(rotary_dim=4, activation="gelu", d_ff=32, tied_head=False)),
    (dict(activation_function="gelu", rotary_dim=12, n_inner=None, layer_norm_epsilon=1e-6),
     dict(rotary_dim=None, activation="gelu_erf", d_ff=None, eps=1e-6)),
    (dict(tie_word_embeddings=True, rotary_dim=8, activation_function="relu"),
     dict(tied_head=True, rotary_dim=8, activation="relu")),
], ids=["gpt-j-like", "whole-head-exact-gelu", "tied-relu"])
def test_a_gptj_folder_is_read_and_matches_from_pretrained(tmp_path, monkeypatch, config,
                                                           expect):
    state = hf_gptj_folder(tmp_path, **config)
    fields = gptj.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.parallel_residual, cfg.shared_norm, cfg.rms_norm, cfg.bias, cfg.ffn_bias,
            cfg.head_bias, cfg.rope_theta) == (True, True, False, False, True, True, 10000.0)
    params = gptj.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    np.testing.assert_array_equal(params["blocks.1.attn.W_V"],
                                  state["transformer.h.1.attn.v_proj.weight"].T)
    q = state["transformer.h.0.attn.q_proj.weight"].T   # head 1's column 12 + 2i + 1 ...
    np.testing.assert_array_equal(params["blocks.0.attn.W_Q"][:, 12 + cfg.rope_width // 2],
                                  q[:, 13])              # ... is tfm's 12 + rope_width / 2 + i
    np.testing.assert_array_equal(params["head.b_U"], state["lm_head.bias"])
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.models.gptj.modeling_gptj.GPTJAttention, "_attn",
                        gptj_scores_in_float64)
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("GPT-J checkpoint")
    assert_folder_matches_hf(transformers.GPTJForCausalLM, tmp_path, loaded,
                             to_float64=gptj_in_float64, grads_of=gptj_grads, attention="eager")


def test_hugging_faces_own_float32_scores_agree_to_their_precision(tmp_path):
    """Unpatched, GPTJForCausalLM takes its scores and RoPE table in float32 even in float64;
    its logits then agree with tfm's to float32's precision, and no closer (the float64 patch
    of the test above is what brings them to 1e-12)."""
    transformers = pytest.importorskip("transformers")
    hf_gptj_folder(tmp_path)
    run_ = tfmcli.load(tmp_path, tokens=TOKENS)
    model = transformers.GPTJForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").double().eval()
    logits, keys = hf_logits(model, run_.inputs, run_.cfg)
    ours = tfmcli.forward(run_.params, run_.inputs, run_.cfg).acts["logits"]
    off = np.abs(logits[keys] - ours[keys]).max() / np.abs(ours[keys]).max()
    assert 1e-12 < off < 1e-5


def test_a_folder_written_back_is_the_same_file(tmp_path):
    """``gptj.from_tfm``: the stored keys and tensors, bit for bit, W_Q's and W_K's columns
    moved back to GPT-J's order."""
    hf_gptj_folder(tmp_path, "float32")
    assert_written_back(gptj, tmp_path)


@pytest.mark.parametrize("change, reason", [
    (dict(rotary_dim=5), "key 'rotary_dim' is 5; RoPE turns pairs of a head's 12 dimensions, "
     "so tfm needs an even number up to 12"),
    (dict(rotary_dim=14), "key 'rotary_dim' is 14; RoPE turns pairs of a head's 12 dimensions, "
     "so tfm needs an even number up to 12"),
    (dict(activation_function="silu"), "key 'activation_function' is 'silu'; tfm reads "
     "'gelu', 'gelu_new', 'gelu_pytorch_tanh', 'relu'"),
    (dict(n_inner="32"), "key 'n_inner' is '32', not a whole number"),
    (dict(n_head=5), "heads"),
], ids=["odd-turn", "wider-than-the-head", "silu", "n-inner-text", "heads-not-dividing"])
def test_a_gptj_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_gptj_folder(tmp_path, "float32")
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "config.json" in line and (line.endswith(reason) if reason != "heads" else
                                      "d_model=24 is not divisible by heads=5" in line)


@pytest.mark.parametrize("key, shape, reason", [
    ("lm_head.bias", None, "missing key 'lm_head.bias'"),
    ("transformer.h.1.mlp.fc_in.weight", (16, 24),
     "key 'transformer.h.1.mlp.fc_in.weight' has shape (16, 24), but config.json says (32, 24)"),
], ids=["missing-head-bias", "half-of-fc-in"])
def test_a_weight_missing_or_of_the_wrong_shape_is_named(tmp_path, key, shape, reason):
    hf_gptj_folder(tmp_path, "float32")
    ignored = {"transformer.h.0.attn.masked_bias": np.ones(1, np.float32)}   # a buffer
    assert_bad_weight_named(gptj, tmp_path, key, shape, reason, ignored)


def test_gpt_j_6b_has_its_parameter_count():
    """EleutherAI/gpt-j-6b's size (GPTJConfig's defaults): 6,050,882,784, the count Hugging
    Face's GPTJForCausalLM gives it on the meta device."""
    cfg = tfmcli.Config(d_model=4096, heads=16, layers=28, vocab=50400, pe="rope",
                        rotary_dim=64, activation="gelu", parallel_residual=True,
                        shared_norm=True, bias=False, ffn_bias=True)
    assert param_count(cfg) == 6_050_882_784


def test_a_config_without_rotary_dim_turns_hugging_faces_default_64(tmp_path, monkeypatch):
    """Issue 59: a config.json of sizes only (no rotary_dim) was read as the whole head turned,
    while GPTJConfig defaults rotary_dim to 64: with heads 128 wide the logits differed by
    5.7e-2. Read as Hugging Face does, it matches from_pretrained; a head narrower than 64,
    which Hugging Face's model cannot run, is refused naming the key."""
    hf_gptj_folder(tmp_path, n_embd=256, n_head=2, rotary_dim=64, n_inner=64, dtype="float32")
    rewrite_config(tmp_path, rotary_dim=None)   # the key removed
    assert gptj.read_config(tmp_path)["rotary_dim"] == 64
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.models.gptj.modeling_gptj.GPTJAttention, "_attn",
                        gptj_scores_in_float64)
    run_ = tfmcli.load(tmp_path, tokens=TOKENS)
    model = gptj_in_float64(transformers.GPTJForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").double().eval(), run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    fwd = tfmcli.forward(run_.params, run_.inputs, run_.cfg)
    # Heads 128 wide at weights of O(1) score up to 79: block 1's softmax is saturated, and its
    # backward's terms are thousands of times its result. dW_Q and dW_K (reached only through
    # it) carry the rounding of those terms, eps x |p dp|, on both sides: the same absolute
    # noise as every other gradient (2e-16), 1.2e-12 of their own small scale on some CPUs.
    # Each is held to 1e-12 of the scale it has before the cancellation; the rest, to 1e-12.
    cancels = {f"blocks.{i}.attn.W_{x}": softmax_cancellation(fwd, grads, i)
               for i in range(run_.cfg.layers) for x in "QK"}
    assert cancels["blocks.1.attn.W_Q"] > 1000 and cancels["blocks.0.attn.W_Q"] < 1000
    for name, grad in gptj_grads(model).items():
        scale = np.abs(grad).max() * cancels.get(name, 1.0)
        np.testing.assert_allclose(grads[name], grad, rtol=0, atol=1e-12 * scale, err_msg=name)
    narrow = tmp_path / "narrow"
    hf_gptj_folder(narrow)   # heads 12 wide
    rewrite_config(narrow, rotary_dim=None)
    assert error_line(run("forward", "--load", narrow), 1).endswith(
        "key 'rotary_dim' is missing, and Hugging Face's default, 64, is wider than a head's 12 "
        "dimensions (its own model cannot run it); give rotary_dim")
