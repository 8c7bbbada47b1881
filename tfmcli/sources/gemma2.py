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

import numpy as np

from tfmcli.sources import gemma, llama

NAME = "Gemma 2"
read_config = llama.read_config


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, each norm's gamma ``1 + weight``."""
    return gemma.load_params(folder, fields, dtype, checkpoint=NAME)


from_tfm = gemma.from_tfm
