"""Phi checkpoint folders (``"model_type": "phi"``: Phi-1, Phi-1.5, Phi-2), as Hugging Face's
``save_pretrained`` writes them. The model is tfm's with ``--pe rope --parallel-residual
--shared-norm --activation gelu``: one layer norm a block, read by attention and the MLP side by
side (``z = x + MHA(LN1(x)) + FFN(LN1(x))``), RoPE on the first ``partial_rotary_factor`` of
each head (0.5 when left out; Phi-2's 0.4), GELU's tanh form for ``hidden_act`` "gelu_new",
biases everywhere, the head's included. The names (a contract, in the README):

    model.embed_tokens -> embed.W_E                      lm_head -> head.W_U, head.b_U
    model.layers.{i}.input_layernorm -> ln1 (.gamma, .beta)
    model.layers.{i}.self_attn.q_proj, k_proj, v_proj, dense -> attn.W_Q, W_K, W_V, W_O (b_*)
    model.layers.{i}.mlp.fc1, fc2 -> ffn.W_1, W_2 (b_1, b_2)
    model.final_layernorm -> ln_f (.gamma, .beta)

Refused: ``qk_layernorm`` (a layer norm of each head's q and k), a ``head_dim`` other than
hidden / heads, another activation, and RoPE scaled other than LLaMA 3.1's or linearly.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import gpt_neox, llama
from tfmcli.sources.folder import need, read_json, shown

NAME = "Phi"
IGNORED = (".rotary_emb.inv_freq",)   # a buffer older folders hold
ROTARY_FACTOR = 0.5   # PhiConfig's partial_rotary_factor when config.json leaves it out


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    d, H = need(path, config, "hidden_size"), need(path, config, "num_attention_heads")
    activation, eps = gpt_neox.common_keys(path, config, "gelu_new", ("qk_layernorm",))
    if config.get("qk_layernorm", False):
        raise TfmError(f"--load {path}: key 'qk_layernorm' is true (a layer norm of each "
                       f"head's q and k with biases), which tfm's --qk-norm does not compute")
    if config.get("head_dim") not in (None, d // H if d % H == 0 else None):
        raise TfmError(f"--load {path}: key 'head_dim' is {shown(config['head_dim'])}; tfm reads "
                       f"Phi's heads {d} / {H} wide")
    theta, scaling = llama.read_rope(path, config)
    kv = None if config.get("num_key_value_heads") is None else need(
        path, config, "num_key_value_heads")
    fields = {"d_model": d, "heads": H, "layers": need(path, config, "num_hidden_layers"),
              "vocab": need(path, config, "vocab_size"),
              "d_ff": need(path, config, "intermediate_size"), "eps": eps,
              "kv_heads": None if kv in (None, H) else kv, "rope_theta": theta,
              "rope_scaling": scaling, "activation": activation, "norm": "pre", "pe": "rope",
              "rms_norm": False, "bias": True, "head_bias": True,
              "tied_head": config.get("tie_word_embeddings", False), "causal": True,
              "parallel_residual": True, "shared_norm": True}
    if d % H == 0:
        share = {"partial_rotary_factor": ROTARY_FACTOR, **config}
        fields["rotary_dim"] = llama.read_rotary_dim(path, share, d // H)
    return llama.runnable(path, fields)


def name_map(fields: dict) -> list[tuple[str, str, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order."""
    shapes = param_shapes(Config(**fields))
    rows = [("model.embed_tokens.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        m, p = f"model.layers.{i}.", f"blocks.{i}."
        rows += [(m + "input_layernorm.weight", p + "ln1.gamma", False),
                 (m + "input_layernorm.bias", p + "ln1.beta", False)]
        for w, proj in zip("QKVO", ("q_proj", "k_proj", "v_proj", "dense")):
            rows += [(m + f"self_attn.{proj}.weight", p + f"attn.W_{w}", True),
                     (m + f"self_attn.{proj}.bias", p + f"attn.b_{w}", False)]
        for w, fc in (("1", "fc1"), ("2", "fc2")):
            rows += [(m + f"mlp.{fc}.weight", p + f"ffn.W_{w}", True),
                     (m + f"mlp.{fc}.bias", p + f"ffn.b_{w}", False)]
    rows += [("model.final_layernorm.weight", "ln_f.gamma", False),
             ("model.final_layernorm.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True), ("lm_head.bias", "head.b_U", False)]
    return [row for row in rows if row[1] in shapes]   # tied: no head.W_U


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``.
    Every key and shape is checked before any is read (``lazy_params``, each read in turn)."""
    return dict(lazy_params(folder, fields, dtype).items())


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``llama.LazyParams``)."""
    rows, shapes = name_map(fields), param_shapes(Config(**fields))
    stored = llama.stored_tensors(folder)
    llama.check_stored(folder, stored, {key: key for key in stored},
                       llama.stored_shapes(rows, shapes), NAME,
                       "lm_head.weight" if fields["tied_head"] else None, IGNORED)
    return llama.LazyParams(stored, {key: key for key in stored}, rows, shapes, dtype)


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under Phi's names (the inverse of ``load_params``), for writing a
    folder."""
    return {key: np.ascontiguousarray(params[name].T if transposed else params[name])
            for key, name, transposed in name_map(fields)}
