"""MPT checkpoint folders (``"model_type": "mpt"``): ALiBi, layer norms without beta, no biases,
q, k and v stacked in one ``Wqkv``. Folders that Hugging Face's ``save_pretrained`` writes from a
random MptForCausalLM, read and run against its ``from_pretrained``; written back; the
refusals; MPT-7B's parameter count.
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
    ok,
    rewrite_config,
    run,
    unpatched_logits_off,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import mpt

SMALL = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=4, max_seq_len=64)   # d_head 4
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_mpt_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "Mpt", {**SMALL, **config}, dtype, seed)


@pytest.fixture
def mpt_in_float64(monkeypatch):
    """Hugging Face's MPT casts its scores to float32 for the softmax (``.float()``) whatever
    the model's dtype; with that cast lifted for float64 tensors its float64 model is tfm's to
    rounding."""
    torch = pytest.importorskip("torch")
    to_float32 = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *args, **kwargs: self
                        if self.dtype == torch.float64 else to_float32(self, *args, **kwargs))
    return lambda model, cfg: model


def mpt_grads(model) -> dict:
    """An MptForCausalLM's gradients under tfm's names: ``Wqkv``'s rows cut as its attention
    cuts them (``chunk(3)``: all of q's, then k's, then v's)."""
    tr = model.transformer
    theirs = {"embed.W_E": tr.wte.weight.grad, "ln_f.gamma": tr.norm_f.weight.grad}
    if model.lm_head.weight is not tr.wte.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, block in enumerate(tr.blocks):
        p = f"blocks.{i}."
        theirs[p + "ln1.gamma"], theirs[p + "ln2.gamma"] = (block.norm_1.weight.grad,
                                                            block.norm_2.weight.grad)
        for x, part in zip("QKV", block.attn.Wqkv.weight.grad.chunk(3, dim=0)):
            theirs[p + f"attn.W_{x}"] = part.T
        for ours, module in (("attn.W_O", block.attn.out_proj), ("ffn.W_1", block.ffn.up_proj),
                             ("ffn.W_2", block.ffn.down_proj)):
            theirs[p + ours] = module.weight.grad.T
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("config", [
    dict(),
    dict(tie_word_embeddings=False, n_heads=2, layer_norm_epsilon=1e-3),
    dict(n_heads=8, d_model=24, attn_config=dict(softmax_scale=0.25)),
    dict(n_heads=6, d_model=24),
], ids=["tied", "untied-two-heads-eps", "eight-heads-softmax-scale", "six-heads"])
def test_an_mpt_folder_is_read_and_matches_from_pretrained(tmp_path, config, mpt_in_float64):
    state = hf_mpt_folder(tmp_path, **config)
    fields = mpt.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.pe, cfg.norm_bias, cfg.activation, cfg.norm, cfg.bias, cfg.head_bias) == (
        "alibi", False, "gelu_erf", "pre", False, False)
    assert cfg.tied_head == config.get("tie_word_embeddings", True)
    assert cfg.eps == config.get("layer_norm_epsilon", 1e-5) and cfg.ff == 4 * cfg.d_model
    assert cfg.score_scale == config.get("attn_config", {}).get("softmax_scale",
                                                                 1 / np.sqrt(cfg.d_head))
    params = mpt.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    # Wqkv's rows: W_Q's d, then W_K's d, then W_V's d
    d = cfg.d_model
    qkv = state["transformer.blocks.1.attn.Wqkv.weight"]
    np.testing.assert_array_equal(params["blocks.1.attn.W_K"], qkv[d:2 * d].T)
    np.testing.assert_array_equal(params["blocks.1.attn.W_V"], qkv[2 * d:].T)
    transformers = pytest.importorskip("transformers")
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("MPT checkpoint")
    assert_folder_matches_hf(transformers.MptForCausalLM, tmp_path, loaded,
                             to_float64=mpt_in_float64, grads_of=mpt_grads, attention=None)


def test_unpatched_mpt_agrees_to_float32s_softmax(tmp_path):
    """Without the patch Hugging Face's float64 MPT differs from tfm's by its float32 softmax:
    more than rounding, well under 1e-5."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_mpt_folder(tmp_path)
    assert 1e-12 < unpatched_logits_off(transformers.MptForCausalLM, tmp_path, TOKENS) < 1e-5


def test_the_slopes_are_hugging_faces():
    """MPT's slopes (the next power of two's sequence, its odd entries first) are the paper's,
    which tfm computes, for every head count when alibi_bias_max is 8."""
    pytest.importorskip("torch")
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from tfmcli.engine.positional import alibi_slopes

    for heads in range(1, 33):
        bias = build_mpt_alibi_tensor(heads, 2).double().numpy()   # (H, 1, 2): -m_h, 0
        np.testing.assert_allclose(-bias[:, 0, 0], alibi_slopes(heads), rtol=1e-7, atol=0)


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False)],
                         ids=["tied", "untied"])
def test_a_folder_written_back_is_the_same_file(tmp_path, config):
    hf_mpt_folder(tmp_path, "float32", **config)
    assert_written_back(mpt, tmp_path)


@pytest.mark.parametrize("change, reason", [
    (dict(attn_config=dict(clip_qkv=6)), "attn_config's 'clip_qkv' is 6 (q, k and v clamped); "
                                         "tfm reads MPT with clip_qkv null"),
    (dict(attn_config=dict(alibi=False)), "attn_config's 'alibi' is false (learned positions "
                                          "(wpe) instead of ALiBi); tfm reads MPT with alibi true"),
    (dict(attn_config=dict(alibi_bias_max=16)), "attn_config's 'alibi_bias_max' is 16 (ALiBi "
                                                "slopes other than the paper's); tfm reads MPT "
                                                "with alibi_bias_max 8"),
    (dict(attn_config=dict(qk_ln=True)), "attn_config's 'qk_ln' is true (a norm of q and k); "
                                         "tfm reads MPT with qk_ln false"),
    (dict(attn_config=dict(attn_type="multiquery_attention")),
     "attn_config's 'attn_type' is 'multiquery_attention'; tfm reads MPT's "
     "'multihead_attention' (each head its own keys and values)"),
    (dict(no_bias=False), "key 'no_bias' is false (biases in every linear layer and norm); tfm "
                          "reads MPT with no_bias true"),
    (dict(logit_scale=0.5), "key 'logit_scale' is 0.5 (the logits scaled); tfm reads MPT with "
                            "logit_scale null"),
    (dict(norm_type="rmsnorm"), "key 'norm_type' is 'rmsnorm'; tfm reads MPT's 'layernorm' or "
                                "'low_precision_layernorm'"),
    (dict(ffn_config=dict(ffn_type="mptglu")), "key 'ffn_config' is {'ffn_type': 'mptglu'}; tfm "
                                               "reads MPT's own FFN (ffn_type 'mptmlp', up_proj "
                                               "and down_proj through GELU)"),
], ids=["clip-qkv", "no-alibi", "bias-max", "qk-ln", "multi-query", "biases", "logit-scale",
        "rms-norm", "glu"])
def test_what_tfm_does_not_compute_is_refused(tmp_path, change, reason):
    hf_mpt_folder(tmp_path, "float32")
    config = rewrite_config(tmp_path)
    if "attn_config" in change:
        change = dict(attn_config={**config["attn_config"], **change["attn_config"]})
    rewrite_config(tmp_path, **change)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "config.json" in line and line.endswith(reason)


def test_the_mosaicml_config_reads_as_hugging_faces_default(tmp_path):
    """MosaicML's own config.json for MPT-7B spells out the defaults (softmax_scale null,
    low_precision_layernorm, learned_pos_emb true beside alibi, an ffn_config): it reads."""
    hf_mpt_folder(tmp_path, "float32")
    config = rewrite_config(tmp_path, norm_type="low_precision_layernorm", learned_pos_emb=True,
                            logit_scale=None, ffn_config=dict(ffn_type="mptmlp", fc_type="torch"))
    rewrite_config(tmp_path, attn_config={**config["attn_config"], "attn_impl": "triton",
                                          "softmax_scale": None, "clip_qkv": None})
    fields = mpt.read_config(tmp_path)
    assert (fields["attn_scale"], fields["norm_bias"], fields["d_ff"]) == (None, False, 64)


def test_mpt_7b_has_its_parameter_count():
    """mosaicml/mpt-7b's size (d 4096, 32 heads, 32 blocks, 50,432 tokens, the head tied, no
    biases, norms without beta): 6,649,286,656, the count Hugging Face's MptForCausalLM gives
    its config on the meta device."""
    cfg = tfmcli.Config(d_model=4096, heads=32, layers=32, vocab=50432, pe="alibi", seq_len=1,
                        activation="gelu_erf", tied_head=True, head_bias=False, bias=False,
                        norm_bias=False)
    assert param_count(cfg) == 6_649_286_656


def test_a_folder_without_its_weights_says_what_one_holds(tmp_path):
    hf_mpt_folder(tmp_path, "float32")
    (tmp_path / "model.safetensors").unlink()
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith("no model.safetensors (or model.safetensors.index.json) there (a "
                         "checkpoint folder holds config.json and its weights)")


@pytest.mark.parametrize("ratio", [None, 2])
def test_the_mlp_is_four_wide_whatever_expansion_ratio_says(tmp_path, ratio):
    """Issue 59: a config.json without expansion_ratio was refused as a missing key, and one of
    2 with a shape error, while Hugging Face's MptMLP always builds 4 d: read as
    from_pretrained builds it."""
    hf_mpt_folder(tmp_path, "float32")
    rewrite_config(tmp_path, expansion_ratio=ratio)
    fields = mpt.read_config(tmp_path)
    assert fields["d_ff"] == 4 * fields["d_model"]
    transformers = pytest.importorskip("transformers")
    model = transformers.MptForCausalLM.from_pretrained(tmp_path)
    assert model.transformer.blocks[0].ffn.up_proj.out_features == fields["d_ff"]
    assert ok("forward", "--load", tmp_path, "--tokens", "1,2,3").exit_code == 0
