"""Gemma 3 checkpoint folders: ``"model_type": "gemma3_text"`` (Gemma 3 270M and 1B, the
text-only ones), and the language model of ``"gemma3"`` (4B, 12B, 27B, which read images
too: its ``text_config``, its weights under ``language_model.``). Gemma 2's block and names
(``sources.gemma2``: a norm before and after each
sublayer, GeGLU, the embedding times sqrt(hidden_size), a tied head, each RMSNorm's gamma
``1 + weight``, the score scale ``query_pre_attn_scalar ** -0.5``), with four differences:

- each head's queries and keys are normalised before RoPE (``--qk-norm``, Qwen3's):
  ``self_attn.q_norm`` and ``k_norm``, their gammas ``1 + weight`` too;
- five layers of each six slide (``sliding_window_pattern`` 6, or ``layer_types``), with a
  window of 512 in 270M and 1B;
- the sliding layers turn at their own RoPE base, ``rope_local_base_freq`` (10000), and the
  full ones at ``rope_theta`` (1e6) with ``rope_scaling`` (``--rope-local-theta``);
- no soft caps (``attn_logit_softcapping`` and ``final_logit_softcapping`` null).

A key config.json leaves out takes Gemma3TextConfig's default. Of an image-and-text folder
the vision tower and its projector are left unread: tfm runs the text.
"""

from __future__ import annotations

import numpy as np

from tfmcli.sources import gemma, llama
from tfmcli.sources.folder import model_type

NAME = "Gemma 3"
read_config = llama.read_config


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, each norm's gamma ``1 + weight``; of an
    image-and-text folder, its language model's."""
    return gemma.load_params(folder, fields, dtype, checkpoint=NAME,
                             text_part=model_type(folder) == "gemma3")


from_tfm = gemma.from_tfm
