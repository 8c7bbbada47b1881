"""GPTBigCode checkpoint folders (``"model_type": "gpt_bigcode"``: SantaCoder, StarCoder,
tiny_starcoder), as Hugging Face's ``save_pretrained`` writes them. The model is GPT-2's (learned
positions, Pre-LN with layer norms, biases everywhere, the head tied to the embedding, GELU's tanh
form) with one key and value head (``multi_query``, ``--kv-heads 1``) and ``nn.Linear``'s
``(out, in)`` weights. The names (a contract, in the README):

    transformer.wte -> embed.W_E          transformer.wpe -> embed.W_pos
    transformer.h.{i}.ln_1, ln_2 -> ln1, ln2 (.gamma, .beta)
    transformer.h.{i}.attn.c_attn -> attn.W_Q, W_K, W_V (and b_Q, b_K, b_V)
    transformer.h.{i}.attn.c_proj -> attn.W_O (b_O)
    transformer.h.{i}.mlp.c_fc, c_proj -> ffn.W_1, W_2 (b_1, b_2)
    transformer.ln_f -> ln_f (.gamma, .beta)          lm_head -> head.W_U (when untied)

``c_attn``'s rows are every query head's, then the key's, then the value's; without
``multi_query``, each head's q, k and v in turn (``fused.grouped_rows`` both). Unscaled scores
(``scale_attn_weights`` false) are ``--attn-scale 1``. Refused: cross-attention.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused, gpt_neox, llama
from tfmcli.sources.folder import need, read_json

NAME = "GPTBigCode"
KEYS = ("activation_function", "layer_norm_epsilon")   # GPT-2's names for them
IGNORED = (".attn.bias", ".attn.masked_bias")   # causal-mask buffers older folders hold


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    switches = ("multi_query", "scale_attn_weights", "add_cross_attention")
    activation, eps = gpt_neox.common_keys(path, config, "gelu_pytorch_tanh", switches, KEYS)
    if config.get("add_cross_attention", False):
        raise TfmError(f"--load {path}: key 'add_cross_attention' is true (attention to an "
                       f"encoder's states), which tfm's decoder does not have")
    H = need(path, config, "n_head")
    n_inner = config.get("n_inner")
    fields = {"d_model": need(path, config, "n_embd"), "heads": H,
              "kv_heads": 1 if config.get("multi_query", True) else None,
              "layers": need(path, config, "n_layer"),
              "vocab": need(path, config, "vocab_size"),
              "n_ctx": need(path, config, "n_positions"),
              "d_ff": None if n_inner is None else need(path, config, "n_inner"),
              "eps": eps, "activation": activation, "norm": "pre", "pe": "learned",
              "attn_scale": None if config.get("scale_attn_weights", True) else 1.0,
              "rms_norm": False, "bias": True, "head_bias": False,
              "tied_head": config.get("tie_word_embeddings", True), "causal": True}
    return llama.runnable(path, fields)


def name_map(fields: dict) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order; the
    fused ``c_attn``'s parameter the tuple (W_Q, W_K, W_V) (or their biases)."""
    shapes = param_shapes(Config(**fields))
    rows = [("transformer.wte.weight", "embed.W_E", False),
            ("transformer.wpe.weight", "embed.W_pos", False)]
    for i in range(fields["layers"]):
        m, p = f"transformer.h.{i}.", f"blocks.{i}."
        rows += [(m + "ln_1.weight", p + "ln1.gamma", False),
                 (m + "ln_1.bias", p + "ln1.beta", False),
                 (m + "attn.c_attn.weight", tuple(p + f"attn.W_{w}" for w in "QKV"), True),
                 (m + "attn.c_attn.bias", tuple(p + f"attn.b_{w}" for w in "QKV"), False),
                 (m + "attn.c_proj.weight", p + "attn.W_O", True),
                 (m + "attn.c_proj.bias", p + "attn.b_O", False),
                 (m + "ln_2.weight", p + "ln2.gamma", False),
                 (m + "ln_2.bias", p + "ln2.beta", False),
                 (m + "mlp.c_fc.weight", p + "ffn.W_1", True),
                 (m + "mlp.c_fc.bias", p + "ffn.b_1", False),
                 (m + "mlp.c_proj.weight", p + "ffn.W_2", True),
                 (m + "mlp.c_proj.bias", p + "ffn.b_2", False)]
    rows += [("transformer.ln_f.weight", "ln_f.gamma", False),
             ("transformer.ln_f.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``c_attn`` cut into W_Q, W_K and W_V (``fused.grouped_rows``). Every key and shape is
    checked before any is read."""
    return fused.load_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, IGNORED)


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    return fused.lazy_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, IGNORED)


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under GPTBigCode's names (the inverse of ``load_params``), for writing a
    folder."""
    return fused.from_tfm(params, fields, name_map(fields))
