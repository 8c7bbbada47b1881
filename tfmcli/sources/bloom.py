"""BLOOM checkpoint folders (``"model_type": "bloom"``: BLOOM, BLOOMZ, bloom-560m to bloom-176b),
as Hugging Face's ``save_pretrained`` writes them. The model is Pre-LN with layer norms and
biases everywhere, its embedding normalised before the first block (``--embed-norm``), ALiBi
for positions (``--pe alibi``), GELU's tanh form, and the head tied to the embedding. The names
(a contract, in the README):

    transformer.word_embeddings -> embed.W_E
    transformer.word_embeddings_layernorm -> ln_embed (.gamma, .beta)
    transformer.h.{i}.input_layernorm, post_attention_layernorm -> ln1, ln2 (.gamma, .beta)
    transformer.h.{i}.self_attention.query_key_value -> attn.W_Q, W_K, W_V (and b_Q, b_K, b_V)
    transformer.h.{i}.self_attention.dense -> attn.W_O (b_O)
    transformer.h.{i}.mlp.dense_h_to_4h, dense_4h_to_h -> ffn.W_1, W_2 (b_1, b_2)
    transformer.ln_f -> ln_f (.gamma, .beta)          lm_head -> head.W_U (when untied)

``query_key_value``'s rows are each head's q, k and v in turn (GPT-NeoX's layout,
``fused.grouped_rows``); ``nn.Linear`` weights ``(out, in)`` are transposed. The checkpoints
BigScience published hold the same names without ``transformer.``: either is read, and a folder
is written with it, as ``save_pretrained`` writes one. Refused:
``apply_residual_connection_post_layernorm`` (the residual taken after the norm).
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused, gpt_neox, llama
from tfmcli.sources.folder import need, read_json

NAME = "BLOOM"
PREFIX = "transformer."   # save_pretrained's; BigScience's own files have none


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    switches = ("apply_residual_connection_post_layernorm", "slow_but_exact")
    # BLOOM names no activation: its GELU is the tanh form
    _, eps = gpt_neox.common_keys(path, config, "gelu_pytorch_tanh", switches,
                                  ("hidden_act", "layer_norm_epsilon"))
    if config.get("apply_residual_connection_post_layernorm", False):
        raise TfmError(f"--load {path}: key 'apply_residual_connection_post_layernorm' is true "
                       f"(each residual taken after its norm), which tfm's blocks do not do")
    tp = config.get("pretraining_tp", 1)
    if config.get("slow_but_exact", False) and isinstance(tp, int) and tp > 1:
        raise TfmError(f"--load {path}: key 'slow_but_exact' is true with pretraining_tp {tp}: "
                       f"Hugging Face's slow path then leaves out the biases of "
                       f"self_attention.dense and mlp.dense_4h_to_h, which its fast path (and "
                       f"tfm) adds; the two readings disagree, so tfm runs neither")
    width = "n_embed" if "n_embed" in config else "hidden_size"   # the first configs' name
    fields = {"d_model": need(path, config, width), "heads": need(path, config, "n_head"),
              "layers": need(path, config, "n_layer"),
              "vocab": need(path, config, "vocab_size"),
              "eps": eps, "activation": "gelu", "norm": "pre", "pe": "alibi",
              "embed_norm": True, "rms_norm": False, "bias": True, "head_bias": False,
              "tied_head": config.get("tie_word_embeddings", True), "causal": True}
    return llama.runnable(path, fields)


def name_map(fields: dict, prefix: str = PREFIX) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order; the
    fused ``query_key_value``'s parameter the tuple (W_Q, W_K, W_V) (or their biases)."""
    shapes = param_shapes(Config(**fields))
    rows = [(prefix + "word_embeddings.weight", "embed.W_E", False),
            (prefix + "word_embeddings_layernorm.weight", "ln_embed.gamma", False),
            (prefix + "word_embeddings_layernorm.bias", "ln_embed.beta", False)]
    for i in range(fields["layers"]):   # GPT-NeoX's block names (both Megatron's)
        rows += gpt_neox.block_rows(f"{prefix}h.{i}.", f"blocks.{i}.", "self_attention.")
    rows += [(prefix + "ln_f.weight", "ln_f.gamma", False),
             (prefix + "ln_f.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``query_key_value`` cut into W_Q, W_K and W_V (``fused.grouped_rows``). Every key and shape
    is checked before any is read."""
    stored = llama.stored_tensors(folder)
    prefix = PREFIX if any(key.startswith(PREFIX) for key in stored) else ""
    return fused.load_params(folder, fields, dtype, name_map(fields, prefix), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, ())


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    stored = llama.stored_tensors(folder)
    prefix = PREFIX if any(key.startswith(PREFIX) for key in stored) else ""
    return fused.lazy_params(folder, fields, dtype, name_map(fields, prefix), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, ())


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under BLOOM's names (the inverse of ``load_params``), for writing a
    folder."""
    return fused.from_tfm(params, fields, name_map(fields))
