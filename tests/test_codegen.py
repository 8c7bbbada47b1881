"""CodeGen checkpoint folders (``"model_type": "codegen"``): GPT-J's block with q, k and v in one
``qkv_proj``, whose output is four pieces, each the queries, values and keys of a quarter of
the heads. Folders that Hugging Face's ``save_pretrained`` writes from a random
CodeGenForCausalLM, read and run against its ``from_pretrained``; written back; the refusals;
CodeGen-350M's parameter count.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_folder_matches_hf,
    assert_written_back,
    error_line,
    gptj_in_float64,
    gptj_scores_in_float64,
    hf_saved,
    rewrite_config,
    run,
)
from tfmcli.engine.sizes import param_count, param_shapes
from tfmcli.sources import codegen, gptj, tensorfile

SMALL = dict(vocab_size=40, n_embd=32, n_layer=2, n_head=8, rotary_dim=2, n_inner=48,
             n_positions=32, n_ctx=32, bos_token_id=1, eos_token_id=2)   # two heads a piece
TOKENS = [[1, 5, 9, 2, 7, 30, 11], [3, 3, 8, 39]]


def hf_codegen_folder(folder, dtype="bfloat16", seed=0, **config):
    return hf_saved(folder, "CodeGen", {**SMALL, **config}, dtype, seed)


def split_qkv(matrix, d: int) -> dict:
    """Hugging Face's own cut of a ``qkv_proj`` ``(3 d, d)``: four pieces of (queries, values,
    keys), each a quarter of the heads, pieces in head order."""
    pieces = matrix.reshape(4, 3, d // 4, d)
    return {w: pieces[:, j].reshape(d, d) for j, w in ((0, "Q"), (1, "V"), (2, "K"))}


def codegen_grads(model) -> dict:
    """A CodeGenForCausalLM's gradients under tfm's names: ``qkv_proj``'s cut by
    ``split_qkv``, W_Q's and W_K's columns in tfm's order."""
    d = model.config.n_embd
    order = gptj.interleaved_order({"d_model": d, "heads": model.config.n_head, "pe": "rope",
                                    "rotary_dim": model.config.rotary_dim})
    theirs = {"embed.W_E": model.transformer.wte.weight.grad,
              "ln_f.gamma": model.transformer.ln_f.weight.grad,
              "ln_f.beta": model.transformer.ln_f.bias.grad, "head.b_U": model.lm_head.bias.grad}
    if model.lm_head.weight is not model.transformer.wte.weight:   # tied: W_E's holds both
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(model.transformer.h):
        p, attn, mlp = f"blocks.{i}.", layer.attn, layer.mlp
        theirs[p + "ln1.gamma"] = layer.ln_1.weight.grad
        theirs[p + "ln1.beta"] = layer.ln_1.bias.grad
        qkv = split_qkv(attn.qkv_proj.weight.grad, d)
        theirs[p + "attn.W_Q"] = qkv["Q"].T[:, order]
        theirs[p + "attn.W_K"] = qkv["K"].T[:, order]
        theirs[p + "attn.W_V"] = qkv["V"].T
        theirs[p + "attn.W_O"] = attn.out_proj.weight.grad.T
        for ours, module in (("ffn.W_1", mlp.fc_in), ("ffn.W_2", mlp.fc_out)):
            theirs[p + ours] = module.weight.grad.T
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


def test_qkv_proj_rows_are_cut_as_hugging_face_cuts_them():
    """d 8 in four pieces of 6 rows: queries, values, keys of one head each (d_head 2, whole
    head turned: the pair (0, 1) is tfm's (0, 1) too)."""
    fields = dict(d_model=8, heads=4, pe="rope")
    rows = gptj.fused_rows(fields)
    assert rows["Q"].tolist() == [0, 1, 6, 7, 12, 13, 18, 19]
    assert rows["V"].tolist() == [2, 3, 8, 9, 14, 15, 20, 21]
    assert rows["K"].tolist() == [4, 5, 10, 11, 16, 17, 22, 23]
    turned = gptj.fused_rows(dict(d_model=16, heads=4, pe="rope", rotary_dim=4))
    assert turned["Q"][:4].tolist() == [0, 2, 1, 3]   # head 0: pairs (0, 1), (2, 3) to halves


@pytest.mark.parametrize("config, expect", [
    (dict(), dict(heads=8, rotary_dim=2, activation="gelu", d_ff=48)),
    (dict(n_head=4, rotary_dim=4, activation_function="gelu"),
     dict(heads=4, rotary_dim=4, activation="gelu_erf")),
    (dict(tie_word_embeddings=True), dict(tied_head=True)),   # issue 59: the tied variant too
], ids=["two-heads-a-piece", "one-head-a-piece-exact-gelu", "tied"])
def test_a_codegen_folder_is_read_and_matches_from_pretrained(tmp_path, monkeypatch, config,
                                                              expect):
    state = hf_codegen_folder(tmp_path, **config)
    fields = codegen.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert {key: getattr(cfg, key) for key in expect} == expect
    assert (cfg.parallel_residual, cfg.shared_norm, cfg.bias, cfg.ffn_bias, cfg.head_bias) == (
        True, True, False, True, True)
    params = codegen.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    qkv = split_qkv(state["transformer.h.1.attn.qkv_proj.weight"], 32)
    np.testing.assert_array_equal(params["blocks.1.attn.W_V"], qkv["V"].T)
    order = gptj.interleaved_order(fields)
    np.testing.assert_array_equal(params["blocks.1.attn.W_K"], qkv["K"].T[:, order])
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.models.codegen.modeling_codegen.CodeGenAttention, "_attn",
                        gptj_scores_in_float64)
    loaded = tfmcli.load(tmp_path, tokens=TOKENS)
    assert loaded.weights_from.startswith("CodeGen checkpoint")
    assert_folder_matches_hf(transformers.CodeGenForCausalLM, tmp_path, loaded,
                             to_float64=gptj_in_float64, grads_of=codegen_grads,
                             attention="eager")


def test_a_folder_written_back_is_the_same_file(tmp_path):
    """``codegen.from_tfm``: W_Q, W_K and W_V put back in their rows of ``qkv_proj``, bit for
    bit."""
    hf_codegen_folder(tmp_path, "float32")
    assert_written_back(codegen, tmp_path)


def test_heads_that_do_not_fill_four_pieces_are_refused(tmp_path):
    """Issue 59 says Hugging Face runs such a folder; the transformers this suite pins does
    not (CodeGenAttention._split_heads reshapes each piece into n_head // 4 heads), so the
    refusal stands, and says so."""
    hf_codegen_folder(tmp_path, "float32")
    rewrite_config(tmp_path, n_head=2)
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "config.json" in line and line.endswith(
        "key 'n_head' is 2; CodeGen's qkv_proj holds its heads in 4 pieces, so tfm needs a "
        "multiple of 4 (Hugging Face's CodeGenAttention cannot split others into heads either)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for heads, width in ((6, 48), (2, 32)):
        model = transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
            **{**SMALL, "n_embd": width, "n_head": heads}))
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            model(torch.tensor([[1, 2, 3]]))


def test_a_missing_qkv_proj_is_named_and_old_buffers_are_skipped(tmp_path):
    hf_codegen_folder(tmp_path, "float32")
    fields = codegen.read_config(tmp_path)
    tensors = codegen.from_tfm(codegen.load_params(tmp_path, fields, np.float32), fields)
    tensors["transformer.h.0.attn.causal_mask"] = np.ones((1, 1), np.float32)   # skipped
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    assert tfmcli.load(tmp_path, tokens=TOKENS).cfg.heads == 8
    del tensors["transformer.h.1.attn.qkv_proj.weight"]
    tensorfile.write(tmp_path / "model.safetensors", tensors)
    assert error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1).endswith(
        "missing key 'transformer.h.1.attn.qkv_proj.weight'")


def test_codegen_350m_has_its_parameter_count():
    """Salesforce/codegen-350M-mono's size: 356,712,448, the count Hugging Face's
    CodeGenForCausalLM gives its config on the meta device."""
    cfg = tfmcli.Config(d_model=1024, heads=16, layers=20, vocab=51200, pe="rope",
                        rotary_dim=32, activation="gelu", parallel_residual=True,
                        shared_norm=True, bias=False, ffn_bias=True)
    assert param_count(cfg) == 356_712_448


def test_a_config_without_rotary_dim_turns_hugging_faces_default_64(tmp_path, monkeypatch):
    """Issue 59: CodeGenConfig defaults rotary_dim to 64; a config.json that leaves it out is
    read so, and matches from_pretrained with heads 128 wide."""
    hf_codegen_folder(tmp_path, n_embd=512, n_head=4, rotary_dim=64, n_inner=64,
                      dtype="float32")
    rewrite_config(tmp_path, rotary_dim=None)   # the key removed
    assert codegen.read_config(tmp_path)["rotary_dim"] == 64
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.models.codegen.modeling_codegen.CodeGenAttention, "_attn",
                        gptj_scores_in_float64)
    assert_folder_matches_hf(transformers.CodeGenForCausalLM, tmp_path,
                             tfmcli.load(tmp_path, tokens=TOKENS), to_float64=gptj_in_float64,
                             grads_of=codegen_grads, attention="eager")
