"""OPT checkpoint folders (``"model_type": "opt"``: Meta's OPT-125M to 66B), as Hugging Face's
``save_pretrained`` writes them. The model is tfm's with ``--pe learned --activation relu
--tied-head --no-head-bias``: learned positions, layer norms with biases before each sublayer
(``do_layer_norm_before``; after them, ``--norm post``, when it is false), biases in every
linear layer (``enable_bias``), the head tied to the embedding. The names (a contract, in the
README):

    model.decoder.embed_tokens -> embed.W_E              lm_head -> head.W_U (when untied)
    model.decoder.embed_positions -> embed.W_pos (its rows from 2 on)
    model.decoder.layers.{i}.self_attn_layer_norm, final_layer_norm -> ln1, ln2 (.gamma, .beta)
    model.decoder.layers.{i}.self_attn.q_proj, k_proj, v_proj, out_proj -> attn.W_Q ... (b_*)
    model.decoder.layers.{i}.fc1, fc2 -> ffn.W_1, W_2 (b_1, b_2)
    model.decoder.final_layer_norm -> ln_f (.gamma, .beta)

OPT's position table has two rows more than its context, ``OFFSET``: position t reads row t + 2
(row 1 is what Hugging Face gives padding positions, whose outputs nothing reads). tfm reads
rows 2 on as ``embed.W_pos``, and a folder written back has zeros in rows 0 and 1.

Refused: a projection between the embedding's width and the blocks' (``word_embed_proj_dim``,
OPT-350M's), layer norms without weights (``layer_norm_elementwise_affine`` false), and
``_remove_final_layer_norm``.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import gpt_neox, llama
from tfmcli.sources.folder import need, read_json, shown

NAME = "OPT"
OFFSET = 2   # rows of embed_positions before position 0's
EPS = 1e-5   # nn.LayerNorm's, which OPT's config does not set


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    d = need(path, config, "hidden_size")
    switches = ("do_layer_norm_before", "enable_bias", "layer_norm_elementwise_affine",
                "_remove_final_layer_norm")
    # the activation and the switches; OPT's config has no epsilon (its norms take EPS)
    activation = gpt_neox.common_keys(path, config, "relu", switches,
                                      ("activation_function", "layer_norm_eps"))[0]
    if config.get("word_embed_proj_dim") not in (None, d):
        raise TfmError(f"--load {path}: key 'word_embed_proj_dim' is "
                       f"{shown(config['word_embed_proj_dim'])}; OPT projects its {d}-wide blocks "
                       f"to that width and back (project_in, project_out), which tfm does not")
    if config.get("layer_norm_elementwise_affine", True) is not True:
        raise TfmError(f"--load {path}: key 'layer_norm_elementwise_affine' is false; tfm's "
                       f"layer norms have a gamma and a beta")
    if config.get("_remove_final_layer_norm", False):
        raise TfmError(f"--load {path}: key '_remove_final_layer_norm' is true; tfm's Pre-LN "
                       f"model ends with ln_f")
    pre = config.get("do_layer_norm_before", True)
    fields = {"d_model": d, "heads": need(path, config, "num_attention_heads"),
              "layers": need(path, config, "num_hidden_layers"),
              "vocab": need(path, config, "vocab_size"), "d_ff": need(path, config, "ffn_dim"),
              "n_ctx": need(path, config, "max_position_embeddings"), "eps": EPS,
              "activation": activation, "norm": "pre" if pre else "post", "pe": "learned",
              "bias": config.get("enable_bias", True), "head_bias": False,
              "tied_head": config.get("tie_word_embeddings", True), "causal": True}
    return llama.runnable(path, fields)


def name_map(fields: dict) -> list[tuple[str, str, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order."""
    shapes = param_shapes(Config(**fields))
    m = "model.decoder."
    rows = [(m + "embed_tokens.weight", "embed.W_E", False),
            (m + "embed_positions.weight", "embed.W_pos", False)]
    for i in range(fields["layers"]):
        k, p = f"{m}layers.{i}.", f"blocks.{i}."
        rows += [(k + "self_attn_layer_norm.weight", p + "ln1.gamma", False),
                 (k + "self_attn_layer_norm.bias", p + "ln1.beta", False)]
        for w, proj in zip("QKVO", ("q_proj", "k_proj", "v_proj", "out_proj")):
            rows += [(k + f"self_attn.{proj}.weight", p + f"attn.W_{w}", True),
                     (k + f"self_attn.{proj}.bias", p + f"attn.b_{w}", False)]
        rows += [(k + "final_layer_norm.weight", p + "ln2.gamma", False),   # the block's own
                 (k + "final_layer_norm.bias", p + "ln2.beta", False)]
        for w in "12":
            rows += [(k + f"fc{w}.weight", p + f"ffn.W_{w}", True),
                     (k + f"fc{w}.bias", p + f"ffn.b_{w}", False)]
    rows += [(m + "final_layer_norm.weight", "ln_f.gamma", False),
             (m + "final_layer_norm.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if row[1] in shapes]   # tied: no head.W_U; Post-LN: no ln_f


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``embed.W_pos`` the position table's rows from ``OFFSET`` on. Every key and shape is checked
    before any is read (``lazy_params``, each read in turn)."""
    return dict(lazy_params(folder, fields, dtype).items())


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``llama.LazyParams``), ``embed.W_pos`` the
    table's rows from ``OFFSET`` on."""
    rows, shapes = name_map(fields), param_shapes(Config(**fields))
    expected = llama.stored_shapes(rows, shapes)
    n_ctx, d = shapes["embed.W_pos"]
    expected["model.decoder.embed_positions.weight"] = (n_ctx + OFFSET, d)
    stored = llama.stored_tensors(folder)
    llama.check_stored(folder, stored, {key: key for key in stored}, expected, NAME,
                       "lm_head.weight" if fields["tied_head"] else None, ())
    return llama.LazyParams(stored, {key: key for key in stored}, rows, shapes, dtype,
                            then=_positions)


def _positions(name: str, value: np.ndarray) -> np.ndarray:
    """The position table's rows from ``OFFSET`` on (``load_params``); the rest as read."""
    return np.ascontiguousarray(value[OFFSET:]) if name == "embed.W_pos" else value


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under OPT's names (the inverse of ``load_params``, the position table's
    first ``OFFSET`` rows zeros), for writing a folder."""
    tensors = {key: np.ascontiguousarray(params[name].T if transposed else params[name])
               for key, name, transposed in name_map(fields)}
    positions = tensors["model.decoder.embed_positions.weight"]
    tensors["model.decoder.embed_positions.weight"] = np.concatenate(
        [np.zeros((OFFSET, positions.shape[1]), positions.dtype), positions])
    return tensors
