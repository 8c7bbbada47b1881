"""MPT checkpoint folders (``"model_type": "mpt"``: MosaicML's MPT-7B and MPT-30B and their
chat, instruct and storywriter tunes), as Hugging Face's ``save_pretrained`` writes them. The
model is Pre-LN with layer norms that have no beta (``--no-norm-bias``), no biases anywhere
(``--no-bias --no-head-bias``), ALiBi for positions (``--pe alibi``), GELU itself
(``gelu_erf``), d_ff 4 d (Hugging Face's ``MptMLP``, whatever ``expansion_ratio`` says), and
the head tied to the embedding unless
``tie_word_embeddings`` is false. The names (a contract, in the README):

    transformer.wte -> embed.W_E
    transformer.blocks.{i}.norm_1, norm_2 -> ln1, ln2 (.gamma)
    transformer.blocks.{i}.attn.Wqkv -> attn.W_Q, W_K, W_V
    transformer.blocks.{i}.attn.out_proj -> attn.W_O
    transformer.blocks.{i}.ffn.up_proj, down_proj -> ffn.W_1, W_2
    transformer.norm_f -> ln_f (.gamma)                  lm_head -> head.W_U (when untied)

``Wqkv``'s rows are W_Q's, W_K's and W_V's, each whole (``fused.stacked_rows``); ``nn.Linear``
weights ``(out, in)`` are transposed. MPT's ALiBi adds ``m_h (j - T + 1)``, which differs from
tfm's ``-m_h (i - j)`` by a constant along each query's row (the softmax takes it out), with the
paper's slopes when ``alibi_bias_max`` is 8, as Hugging Face's MPT always computes them. Refused
(``attn_config``): learned positions instead of ALiBi, another ``alibi_bias_max``, ``clip_qkv``
(q, k and v clamped), ``qk_ln``, a prefix LM, multi-query or grouped attention; and biases
(``no_bias`` false), ``logit_scale``, another ``norm_type``, a gated FFN (``ffn_config``).
"""

from __future__ import annotations

import json

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused, gpt_neox, llama
from tfmcli.sources.folder import need, number, read_json, shown

NAME = "MPT"
NORMS = ("layernorm", "low_precision_layernorm")   # the same norm, computed in another precision
# attn_config's keys whose values tfm computes: (key, the value it needs, what another means)
ATTENTION = (("alibi", True, "learned positions (wpe) instead of ALiBi"),
             ("alibi_bias_max", 8, "ALiBi slopes other than the paper's"),
             ("clip_qkv", None, "q, k and v clamped"),
             ("qk_ln", False, "a norm of q and k"),
             ("prefix_lm", False, "a prefix that attends both ways"))


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    _, eps = gpt_neox.common_keys(path, config, "gelu", (), ("hidden_act", "layer_norm_epsilon"))
    attention = config.get("attn_config") or {}
    if not isinstance(attention, dict):
        raise TfmError(f"--load {path}: key 'attn_config' is {shown(attention)}, not an object")
    for key, needed, other in ATTENTION:
        _refuse(path, attention, key, needed, other, "attn_config's ")
    kind = attention.get("attn_type", "multihead_attention")
    if kind != "multihead_attention":
        raise TfmError(f"--load {path}: attn_config's 'attn_type' is {shown(kind)}; tfm reads "
                       f"MPT's 'multihead_attention' (each head its own keys and values)")
    scale = attention.get("softmax_scale")
    if scale is not None:
        scale = number(path, "attn_config's 'softmax_scale'", scale)
    _refuse(path, config, "no_bias", True, "biases in every linear layer and norm", "key ")
    _refuse(path, config, "logit_scale", None, "the logits scaled", "key ")
    if config.get("norm_type", NORMS[1]) not in NORMS:
        raise TfmError(f"--load {path}: key 'norm_type' is {shown(config['norm_type'])}; tfm reads "
                       f"MPT's {' or '.join(map(repr, NORMS))}")
    ffn = config.get("ffn_config") or {}
    if (not isinstance(ffn, dict) or ffn.get("ffn_type", "mptmlp") != "mptmlp"
            or set(ffn) - {"ffn_type", "fc_type"}):
        raise TfmError(f"--load {path}: key 'ffn_config' is {shown(ffn)}; tfm reads MPT's own FFN "
                       f"(ffn_type 'mptmlp', up_proj and down_proj through GELU)")
    d = need(path, config, "d_model")
    fields = {"d_model": d, "heads": need(path, config, "n_heads"),
              "layers": need(path, config, "n_layers"),
              "vocab": need(path, config, "vocab_size"),
              # Hugging Face's MptMLP is 4 d wide whatever expansion_ratio says (MosaicML's own
              # code reads the key): tfm reads the model from_pretrained builds
              "d_ff": 4 * d,
              "eps": eps, "activation": "gelu_erf", "norm": "pre", "pe": "alibi",
              "rms_norm": False, "norm_bias": False, "bias": False, "head_bias": False,
              "attn_scale": scale,
              "tied_head": config.get("tie_word_embeddings", True), "causal": True}
    return llama.runnable(path, fields)


def _refuse(path, config: dict, key: str, needed, other: str, where: str) -> None:
    """TfmError unless ``config[key]`` is ``needed`` (or left out): ``other`` says what another
    value means, ``where`` whose key it is ("key ", "attn_config's ")."""
    value = config.get(key, needed)
    if value != needed or isinstance(value, bool) != isinstance(needed, bool):
        said = json.dumps(value) if value is None or isinstance(value, bool) else shown(value)
        raise TfmError(f"--load {path}: {where}{key!r} is {said} ({other}); tfm "
                       f"reads MPT with {key} {json.dumps(needed)}")


def name_map(fields: dict) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order; the
    fused ``Wqkv``'s parameter the tuple (W_Q, W_K, W_V)."""
    shapes = param_shapes(Config(**fields))
    rows = [("transformer.wte.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        m, p = f"transformer.blocks.{i}.", f"blocks.{i}."
        rows += [(m + "norm_1.weight", p + "ln1.gamma", False),
                 (m + "attn.Wqkv.weight", tuple(p + f"attn.W_{w}" for w in "QKV"), True),
                 (m + "attn.out_proj.weight", p + "attn.W_O", True),
                 (m + "norm_2.weight", p + "ln2.gamma", False),
                 (m + "ffn.up_proj.weight", p + "ffn.W_1", True),
                 (m + "ffn.down_proj.weight", p + "ffn.W_2", True)]
    rows += [("transformer.norm_f.weight", "ln_f.gamma", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``Wqkv`` cut into W_Q, W_K and W_V (``fused.stacked_rows``). Every key and shape is checked
    before any is read."""
    return fused.load_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, (),
                             fused.stacked_rows(fields))


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    return fused.lazy_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, (),
                             fused.stacked_rows(fields))


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under MPT's names (the inverse of ``load_params``), for writing a
    folder."""
    return fused.from_tfm(params, fields, name_map(fields), fused.stacked_rows(fields))
