"""Gemma 2 checkpoint folders (``"model_type": "gemma2"``: Gemma 2 2B, 9B and 27B): Gemma's
names, files and norms (``sources.gemma``: GeGLU, the embedding times sqrt(hidden_size), a tied
head, each RMSNorm's gamma ``1 + weight``), and four differences in the block and the head:

- a norm on each sublayer's output too, before its residual sum (``--sandwich-norm``):
  ``post_attention_layernorm`` is ``ln1_post``, ``pre_feedforward_layernorm`` ``ln2`` and
  ``post_feedforward_layernorm`` ``ln2_post``;
- the scores soft-capped at ``attn_logit_softcapping`` (50) and the logits at
  ``final_logit_softcapping`` (30) (``--attn-softcap``, ``--logit-softcap``; null: no cap);
- the scores scaled by ``query_pre_attn_scalar ** -0.5`` (``--attn-scale``: 27B's 144 with
  heads of 128; 2B's and 9B's 256 is 1 / sqrt(head_dim) itself);
- a sliding window of ``sliding_window`` (4096) in the layers ``layer_types`` calls
  ``sliding_attention``, the even ones when it is absent (``--sliding-layers``).

A key config.json leaves out takes Gemma2Config's default.
"""

from __future__ import annotations

import math

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources import gemma, llama
from tfmcli.sources.folder import need, shown

NAME = "Gemma 2"
DEFAULTS = {"sliding_window": 4096, "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}   # Gemma2Config's


def read_config(folder) -> dict:
    """Config fields from a Gemma 2 folder's ``config.json``: Gemma's, 4 key/value heads when
    ``num_key_value_heads`` is left out, the even layers sliding, and ``sandwich_fields``."""
    path, config = llama.config_of(folder, "gemma2", NAME, defaults=DEFAULTS)
    window = llama.sliding(path, config, config.get("sliding_window"),
                           lambda layers: list(range(0, layers, 2)))
    fields = gemma.read_fields(path, config, NAME, kv_heads=4, window=window)
    return llama.runnable(path, {**fields, **sandwich_fields(path, config, llama.d_head(fields))})


def sandwich_fields(path, config: dict, d_head: int) -> dict:
    """Gemma 2's (and 3's) soft caps (``attn_logit_softcapping``, ``final_logit_softcapping``;
    null: no cap), its score scale ``query_pre_attn_scalar ** -0.5`` as Hugging Face computes it
    (None when that is tfm's own 1 / sqrt(d_head)), and its sandwich norms."""
    fields = {"sandwich_norm": True}
    for key, field in (("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "logit_softcap")):
        cap = config.get(key)
        fields[field] = None if cap is None else need(path, config, key, (int, float))
    scalar = need(path, config, "query_pre_attn_scalar", (int, float))
    if scalar <= 0:
        raise TfmError(f"--load {path}: key 'query_pre_attn_scalar' is "
                       f"{shown(config['query_pre_attn_scalar'])}, not a positive number")
    scale = scalar ** -0.5
    fields["attn_scale"] = None if scale == 1.0 / math.sqrt(d_head) else scale
    return fields



def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, each norm's gamma ``1 + weight``."""
    return gemma.load_params(folder, fields, dtype, checkpoint=NAME)


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``gemma.lazy_params``)."""
    return gemma.lazy_params(folder, fields, dtype, checkpoint=NAME)


from_tfm = gemma.from_tfm
