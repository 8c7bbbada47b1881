"""Gemma 3 checkpoint folders (``"model_type": "gemma3_text"``: Gemma 3 270M and 1B, the
text-only ones): Gemma 2's block and names (``sources.gemma2``: a norm before and after each
sublayer, GeGLU, the embedding times sqrt(hidden_size), a tied head, each RMSNorm's gamma
``1 + weight``, the score scale ``query_pre_attn_scalar ** -0.5``), with four differences:

- each head's queries and keys are normalised before RoPE (``--qk-norm``, Qwen3's):
  ``self_attn.q_norm`` and ``k_norm``, their gammas ``1 + weight`` too;
- five layers of each six slide (``sliding_window_pattern`` 6, or ``layer_types``), with a
  window of 512 in 270M and 1B;
- the sliding layers turn at their own RoPE base, ``rope_local_base_freq`` (10000), and the
  full ones at ``rope_theta`` (1e6) with ``rope_scaling`` (``--rope-local-theta``);
- no soft caps (``attn_logit_softcapping`` and ``final_logit_softcapping`` null).

A key config.json leaves out takes Gemma3TextConfig's default. The larger Gemma 3s (4B, 12B,
27B: ``"model_type": "gemma3"``) hold this model inside an image-and-text one and are not read.
"""

from __future__ import annotations

import numpy as np

from tfmcli.sources import gemma, llama

NAME = "Gemma 3"
read_config = llama.read_config


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, each norm's gamma ``1 + weight``."""
    return gemma.load_params(folder, fields, dtype, checkpoint=NAME)


from_tfm = gemma.from_tfm
