"""Falcon checkpoint folders (``"model_type": "falcon"``: Falcon-7B, 40B, 180B, Falcon 2 11B), as
Hugging Face's ``save_pretrained`` writes them. The model is tfm's with ``--pe rope --activation
gelu_erf --tied-head --no-head-bias``, layer norms with biases, biases in the linear layers when
``bias`` says (Falcon-7B's have none), and one of three blocks:

- ``parallel_attn`` (Falcon-7B's): attention and the MLP side by side on one norm,
  ``--parallel-residual --shared-norm``;
- ``new_decoder_architecture`` (40B's, 180B's): side by side on a norm each (``ln_attn``,
  ``ln_mlp``), ``--parallel-residual``; on one norm when ``num_ln_in_parallel_attn`` is 1
  (Falcon 2 11B's);
- otherwise the sequential Pre-LN block.

Keys and values: one head (``multi_query``, Falcon-7B's), ``num_kv_heads`` (the new
architecture's), or a head each. The names (a contract, in the README):

    transformer.word_embeddings -> embed.W_E              lm_head -> head.W_U (when untied)
    transformer.h.{i}.input_layernorm (or ln_attn) -> ln1 (.gamma, .beta)
    transformer.h.{i}.post_attention_layernorm (or ln_mlp) -> ln2 (.gamma, .beta)
    transformer.h.{i}.self_attention.query_key_value -> attn.W_Q, W_K, W_V (and b_*)
    transformer.h.{i}.self_attention.dense -> attn.W_O (b_O)
    transformer.h.{i}.mlp.dense_h_to_4h, dense_4h_to_h -> ffn.W_1, W_2 (b_1, b_2)
    transformer.ln_f -> ln_f (.gamma, .beta)

``query_key_value``'s output is one piece per key head, each the queries of the heads it
serves, then its key, then its value (``fused.grouped_rows``, GPT-NeoX's layout too). Refused: ALiBi
(``alibi``, Falcon-RW's
positions), and the new architecture with one norm but not side by side, which Hugging Face's
own model does not run.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused, gpt_neox, llama
from tfmcli.sources.folder import need, read_json, shown

NAME = "Falcon"
KEYS = ("activation", "layer_norm_epsilon")   # Falcon's names for them


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    switches = ("alibi", "bias", "multi_query", "parallel_attn", "new_decoder_architecture")
    activation, eps = gpt_neox.common_keys(path, config, "gelu", switches, KEYS)
    if config.get("alibi", False):
        raise TfmError(f"--load {path}: key 'alibi' is true (Falcon-RW's ALiBi positions, a "
                       f"slope a head added to the scores), which tfm does not compute")
    d, H = need(path, config, "hidden_size"), need(path, config, "num_attention_heads")
    new = config.get("new_decoder_architecture", False)
    parallel = config.get("parallel_attn", True)
    if new:
        kv = config.get("num_kv_heads")
        kv = H if kv is None else need(path, config, "num_kv_heads")
        norms = config.get("num_ln_in_parallel_attn") or 2
        if isinstance(norms, bool) or norms not in (1, 2):
            raise TfmError(f"--load {path}: key 'num_ln_in_parallel_attn' is {shown(norms)}; "
                           f"Falcon's block has 1 or 2 norms")
        if norms == 1 and not parallel:
            raise TfmError(f"--load {path}: key 'parallel_attn' is false with the new "
                           f"architecture's one norm, a block Hugging Face's Falcon does not run")
        shared = norms == 1
    else:
        kv = 1 if config.get("multi_query", True) else H
        shared = parallel
    theta, scaling = llama.read_rope(path, config)
    ffn = config.get("ffn_hidden_size")
    fields = {"d_model": d, "heads": H, "kv_heads": None if kv == H else kv,
              "layers": need(path, config, "num_hidden_layers"),
              "vocab": need(path, config, "vocab_size"),
              "d_ff": None if ffn is None else need(path, config, "ffn_hidden_size"),
              "eps": eps, "activation": activation, "norm": "pre", "pe": "rope",
              "rope_theta": theta, "rope_scaling": scaling, "rms_norm": False,
              "bias": config.get("bias", False), "head_bias": False,
              "tied_head": config.get("tie_word_embeddings", True), "causal": True,
              "parallel_residual": new or parallel, "shared_norm": shared}
    return llama.runnable(path, fields)


def _norm_keys(fields: dict) -> tuple[str, str]:
    """The stored names of a block's two norms: Falcon-40B's own pair when its block is
    parallel with two, else ``input_layernorm`` and (sequential) ``post_attention_layernorm``."""
    if fields["parallel_residual"] and not fields["shared_norm"]:
        return "ln_attn", "ln_mlp"
    return "input_layernorm", "post_attention_layernorm"


def name_map(fields: dict) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order; the
    fused ``query_key_value``'s parameter the tuple (W_Q, W_K, W_V) (or their biases)."""
    shapes = param_shapes(Config(**fields))
    first, second = _norm_keys(fields)
    rows = [("transformer.word_embeddings.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        m, p = f"transformer.h.{i}.", f"blocks.{i}."
        rows += [(m + f"{first}.weight", p + "ln1.gamma", False),
                 (m + f"{first}.bias", p + "ln1.beta", False),
                 (m + "self_attention.query_key_value.weight",
                  tuple(p + f"attn.W_{w}" for w in "QKV"), True),
                 (m + "self_attention.query_key_value.bias",
                  tuple(p + f"attn.b_{w}" for w in "QKV"), False),
                 (m + "self_attention.dense.weight", p + "attn.W_O", True),
                 (m + "self_attention.dense.bias", p + "attn.b_O", False),
                 (m + f"{second}.weight", p + "ln2.gamma", False),
                 (m + f"{second}.bias", p + "ln2.beta", False),
                 (m + "mlp.dense_h_to_4h.weight", p + "ffn.W_1", True),
                 (m + "mlp.dense_h_to_4h.bias", p + "ffn.b_1", False),
                 (m + "mlp.dense_4h_to_h.weight", p + "ffn.W_2", True),
                 (m + "mlp.dense_4h_to_h.bias", p + "ffn.b_2", False)]
    rows += [("transformer.ln_f.weight", "ln_f.gamma", False),
             ("transformer.ln_f.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``query_key_value`` cut one piece per key head (``fused.grouped_rows``). Every key and shape
    is checked before any is read."""
    return fused.load_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, ())


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    return fused.lazy_params(folder, fields, dtype, name_map(fields), NAME,
                             "lm_head.weight" if fields["tied_head"] else None, ())


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under Falcon's names (the inverse of ``load_params``: W_Q, W_K and W_V
    put back in their rows of ``query_key_value``), for writing a folder."""
    return fused.from_tfm(params, fields, name_map(fields))
