"""GPT-NeoX checkpoint folders (``"model_type": "gpt_neox"``: Pythia 70M to 12B, GPT-NeoX-20B), as
Hugging Face's ``save_pretrained`` writes them. The model is tfm's with ``--pe rope
--parallel-residual --activation gelu_erf --no-head-bias`` and layer norms with biases: RoPE on
the first ``rotary_pct`` of each head (a quarter by default), attention and the MLP side by side
when ``use_parallel_residual`` says (Pythia's do), GELU itself for ``hidden_act`` "gelu".
The names (a contract, in the README):

    gpt_neox.embed_in -> embed.W_E                       embed_out -> head.W_U
    gpt_neox.layers.{i}.input_layernorm, post_attention_layernorm -> ln1, ln2 (.gamma, .beta)
    gpt_neox.layers.{i}.attention.query_key_value -> attn.W_Q, W_K, W_V (and b_Q, b_K, b_V)
    gpt_neox.layers.{i}.attention.dense -> attn.W_O (b_O)
    gpt_neox.layers.{i}.mlp.dense_h_to_4h, dense_4h_to_h -> ffn.W_1, W_2 (b_1, b_2)
    gpt_neox.final_layer_norm -> ln_f (.gamma, .beta)

``query_key_value`` holds each head's q, k and v rows one after another, head by head (its
output viewed ``(H, 3 d_head)``, then cut in three): its rows ``(H, 3, d_head)``.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused, llama
from tfmcli.sources.folder import known, need, number, read_json, shown

NAME = "GPT-NeoX"
IGNORED = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")   # buffers
ACTIVATIONS = {"gelu": "gelu_erf", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "relu": "relu"}   # Hugging Face's names -> tfm's


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly (another activation, RoPE scaled other than LLaMA 3.1's or linearly).
    ``attention_bias`` false leaves the MLP's biases alone (``--no-bias --ffn-bias``)."""
    path, config = read_json(folder)
    d, H = need(path, config, "hidden_size"), need(path, config, "num_attention_heads")
    activation, eps = common_keys(path, config, "gelu",
                                  ("attention_bias", "use_parallel_residual"))
    attention_bias = config.get("attention_bias", True)   # false: the MLP's alone (--ffn-bias)
    theta, scaling, factor_at = _rope(path, config)
    fields = {"d_model": d, "heads": H, "layers": need(path, config, "num_hidden_layers"),
              "vocab": need(path, config, "vocab_size"),
              "d_ff": need(path, config, "intermediate_size"), "eps": eps,
              "rope_theta": theta, "rope_scaling": scaling, "activation": activation,
              "norm": "pre", "pe": "rope", "rms_norm": False, "bias": attention_bias,
              "ffn_bias": not attention_bias, "head_bias": False,
              "tied_head": config.get("tie_word_embeddings", False), "causal": True,
              "parallel_residual": config.get("use_parallel_residual", True)}
    if d % H == 0:
        fields["rotary_dim"] = llama.read_rotary_dim(path, factor_at, d // H, top="rotary_pct")
    return llama.runnable(path, fields)


def common_keys(path, config: dict, default_act: str, switches: tuple,
                keys: tuple = ("hidden_act", "layer_norm_eps")) -> tuple[str, float]:
    """(tfm's activation, the norms' epsilon) of a GPT-NeoX's, Phi's or GPT-J's config: the
    activation's key (``hidden_act``; GPT-J's ``activation_function``), ``default_act`` when
    left out, one of ``ACTIVATIONS``; the epsilon's (``layer_norm_eps``; GPT-J's
    ``layer_norm_epsilon``), 1e-5 when left out, a number; and each of ``switches`` and
    ``tie_word_embeddings`` true or false when given."""
    act_key, eps_key = keys
    activation = config.get(act_key, default_act)
    if not known(activation, ACTIVATIONS):
        raise TfmError(f"--load {path}: key {act_key!r} is {shown(activation)}; tfm "
                       f"reads {', '.join(map(repr, ACTIVATIONS))}")
    for key in (*switches, "tie_word_embeddings"):
        if not isinstance(config.get(key, False), bool):
            raise TfmError(f"--load {path}: key {key!r} is {shown(config[key])}, not true or "
                           f"false")
    return ACTIVATIONS[activation], number(path, f"key {eps_key!r}", config.get(eps_key, 1e-5))


def _rope(path, config: dict):
    """(theta, scaling, where the rotary share is): GPTNeoXConfig's order, ``rope_scaling`` or
    ``rope_parameters`` first (their ``rope_theta`` and ``partial_rotary_factor``), then the
    first configs' ``rotary_emb_base`` (10000) and ``rotary_pct`` (0.25)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if not isinstance(rope, dict):
        raise TfmError(f"--load {path}: key {key!r} is {shown(rope)}, not an object")
    scaling = llama.read_scaling(path, key, rope)
    raw = rope.get("rope_theta", config.get("rotary_emb_base", 10000.0))
    theta = number(path, f"key {key!r} 'rope_theta'" if "rope_theta" in rope else
                   "key 'rotary_emb_base'", raw)
    if theta <= 0:
        raise TfmError(f"--load {path}: RoPE's base (rope_theta or rotary_emb_base) is "
                       f"{shown(raw)}, not a positive number")
    share = {key: rope} if "partial_rotary_factor" in rope else {
        "rotary_pct": config.get("rotary_pct", 0.25)}
    return float(theta), scaling, share


def block_rows(m: str, p: str, attention: str) -> list[tuple[str, str | tuple, bool]]:
    """A block's rows of ``name_map`` in Megatron's names, which GPT-NeoX's and BLOOM's blocks
    share (stored under ``m``, tfm's under ``p``; the attention module's name ``attention``:
    GPT-NeoX's "attention.", BLOOM's "self_attention.")."""
    a = m + attention
    return [(m + "input_layernorm.weight", p + "ln1.gamma", False),
            (m + "input_layernorm.bias", p + "ln1.beta", False),
            (a + "query_key_value.weight", tuple(p + f"attn.W_{w}" for w in "QKV"), True),
            (a + "query_key_value.bias", tuple(p + f"attn.b_{w}" for w in "QKV"), False),
            (a + "dense.weight", p + "attn.W_O", True),
            (a + "dense.bias", p + "attn.b_O", False),
            (m + "post_attention_layernorm.weight", p + "ln2.gamma", False),
            (m + "post_attention_layernorm.bias", p + "ln2.beta", False),
            (m + "mlp.dense_h_to_4h.weight", p + "ffn.W_1", True),
            (m + "mlp.dense_h_to_4h.bias", p + "ffn.b_1", False),
            (m + "mlp.dense_4h_to_h.weight", p + "ffn.W_2", True),
            (m + "mlp.dense_4h_to_h.bias", p + "ffn.b_2", False)]


def name_map(fields: dict) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order; the
    ``query_key_value`` rows name (Q, K, V), interleaved head by head in the stored matrix."""
    shapes = param_shapes(Config(**fields))
    rows = [("gpt_neox.embed_in.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        rows += block_rows(f"gpt_neox.layers.{i}.", f"blocks.{i}.", "attention.")
    rows += [("gpt_neox.final_layer_norm.weight", "ln_f.gamma", False),
             ("gpt_neox.final_layer_norm.bias", "ln_f.beta", False),
             ("embed_out.weight", "head.W_U", True)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``;
    ``query_key_value`` cut head by head into q, k and v (``fused.grouped_rows``, a key head
    each). Every key and shape is checked before any is read."""
    return fused.load_params(folder, fields, dtype, name_map(fields), NAME,
                             "embed_out.weight" if fields["tied_head"] else None, IGNORED)


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    return fused.lazy_params(folder, fields, dtype, name_map(fields), NAME,
                             "embed_out.weight" if fields["tied_head"] else None, IGNORED)


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under GPT-NeoX's names (the inverse of ``load_params``), q, k and v
    interleaved head by head again, for writing a folder."""
    return fused.from_tfm(params, fields, name_map(fields))
