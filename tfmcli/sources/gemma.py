"""Gemma checkpoint folders (``"model_type": "gemma"``: Gemma 2B and 7B, CodeGemma): LLaMA's
names and files (``sources.llama`` reads them), with three differences in the model:

- the FFN is GeGLU, GELU's tanh form where LLaMA has silu (``--activation geglu``);
- the embedding is multiplied by sqrt(hidden_size) before the first block (``--embed-scale``),
  and the head is tied to it unless ``tie_word_embeddings`` says false;
- each RMSNorm multiplies by ``1 + weight``: the weights are stored as offsets from 1, so
  ``ln1``, ``ln2`` and ``ln_f``'s gammas are ``1 + weight``, added in the run's dtype: in
  float32 the sum Hugging Face's GemmaRMSNorm makes, in float64 the exact one. Their gradients
  are the weights'.

Heads are ``head_dim`` wide (256 when config.json has none, GemmaConfig's default), and 2B's
keys and values are one head (``num_key_value_heads`` 1: multi-query attention). No biases
(``attention_bias`` true, which would put one on o_proj and none in the MLP, is refused).
Gemma 2 (``gemma2``: soft caps, norms around each sublayer, layers that alternate a sliding
window) is ``sources.gemma2``; Gemma 3 (``gemma3_text``, and ``gemma3``'s language model: q
and k norms, a RoPE base of the sliding layers' own besides) is ``sources.gemma3``.
"""

from __future__ import annotations

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources import llama
from tfmcli.sources.folder import shown

NAME = "Gemma"
GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_new")   # Gemma's names for GELU's tanh form


def read_config(folder) -> dict:
    """Config fields from a Gemma folder's ``config.json`` (``read_fields``)."""
    path, config = llama.config_of(folder, "gemma", NAME)
    return llama.runnable(path, read_fields(path, config, NAME, kv_heads=16))


def read_fields(path, config: dict, name: str, kv_heads: int, window: tuple = (None, None)):
    """LLaMA's keys read as every Gemma's: GeGLU with GELU's tanh form (``hidden_act`` or
    ``hidden_activation`` 'gelu', 'gelu_pytorch_tanh' or 'gelu_new'), heads 256 wide when
    ``head_dim`` is left out, the embedding times sqrt(d), a head tied unless
    ``tie_word_embeddings`` says false, no biases (``attention_bias`` refused), and causal
    (``use_bidirectional_attention`` refused). ``kv_heads``: the family's default."""
    for key in ("hidden_act", "hidden_activation"):
        value = config.get(key)
        if value is not None and value not in GELU_TANH:
            raise TfmError(f"--load {path}: key {key!r} is {shown(value)}; tfm's Gemma FFN is "
                           f"GeGLU with GELU's tanh form ('gelu_pytorch_tanh')")
    if config.get("use_bidirectional_attention"):
        raise TfmError(f"--load {path}: key 'use_bidirectional_attention' is "
                       f"{shown(config['use_bidirectional_attention'])}; tfm reads Gemma as the "
                       f"causal language model it is trained as")
    fields = llama.read_fields(path, config, llama.no_attention_bias(path, config, name),
                               kv_heads=kv_heads, head_dim=256, activation="geglu", tied=True,
                               window=window)
    return {**fields, "embed_scale": True}



def load_params(folder, fields: dict, dtype, checkpoint: str = NAME,
                text_part: bool = False) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names (``llama.load_params``; ``text_part``: an
    image-and-text model's language model), each norm's gamma ``1 + weight``."""
    params = llama.load_params(folder, fields, dtype, checkpoint=checkpoint, text_part=text_part)
    for name, value in params.items():
        if name.endswith(".gamma"):
            value += 1.0
    return params


def lazy_params(folder, fields: dict, dtype, checkpoint: str = NAME,
                text_part: bool = False) -> llama.LazyParams:
    """``load_params``' weights read when used (``llama.LazyParams``), each gamma made
    ``1 + weight`` as it is read, as ``load_params`` makes it."""
    return llama.lazy_params(folder, fields, dtype, checkpoint=checkpoint, text_part=text_part,
                             then=_gamma)


def _gamma(name: str, value: np.ndarray) -> np.ndarray:
    """A norm's stored weight to its gamma, ``1 + weight`` (in place, as ``load_params``)."""
    if name.endswith(".gamma"):
        value += 1.0
    return value


def from_tfm(params: dict, fields: dict) -> dict[str, np.ndarray]:
    """tfm's parameters under Gemma's names (the inverse of ``load_params``), each norm's weight
    ``gamma - 1``, for writing a folder."""
    return llama.from_tfm({name: value - 1.0 if name.endswith(".gamma") else value
                           for name, value in params.items()}, fields)
