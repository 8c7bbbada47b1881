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

from tfmcli.errors import TfmError
from tfmcli.sources import gemma, gemma2, llama
from tfmcli.sources.folder import number, read_json, shown

NAME = "Gemma 3"
DEFAULTS = {"sliding_window": 4096, "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "sliding_window_pattern": 6}   # Gemma3TextConfig's
THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}   # its RoPE bases


def read_config(folder) -> dict:
    """Config fields from a Gemma 3 folder's ``config.json`` (of an image-and-text one, its
    ``text_config``): Gemma 2's, with five layers of each ``sliding_window_pattern`` sliding,
    each head's queries and keys normalised, and RoPE's bases of the two kinds of layer
    (``rope``). Refused: no ``sliding_window``, and scores capped (``attn_logit_softcapping``,
    which Hugging Face's Gemma 3 does not apply)."""
    path, config = read_json(folder)
    if config.get("model_type") == "gemma3":   # 4B+: an image-and-text model; tfm reads the text
        config = text_config(path, config)
    config = {**DEFAULTS, **config}
    if config.get("model_type") != "gemma3_text":
        raise TfmError(f"--load {path}: key 'model_type' is {shown(config.get('model_type'))}, "
                       f"not a {NAME} checkpoint's 'gemma3_text' or 'gemma3'")
    if config["sliding_window"] is None:
        raise TfmError(f"--load {path}: key 'sliding_window' is null; a Gemma 3's sliding "
                       f"layers need a window (and turn at a RoPE base of their own)")
    if config.get("attn_logit_softcapping") is not None:
        raise TfmError(f"--load {path}: key 'attn_logit_softcapping' is "
                       f"{shown(config['attn_logit_softcapping'])}, which Hugging Face's Gemma 3 "
                       f"does not apply (its scores are not capped); tfm will not guess which "
                       f"is meant")
    pattern = config["sliding_window_pattern"]

    def all_but_each_pattern_th(layers: int) -> list[int]:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise TfmError(f"--load {path}: key 'sliding_window_pattern' is {shown(pattern)}, "
                           f"not a positive whole number")
        return [i for i in range(layers) if (i + 1) % pattern]

    window = llama.sliding(path, config, config["sliding_window"], all_but_each_pattern_th)
    fields = gemma.read_fields(path, config, NAME, kv_heads=4, window=window)
    theta, scaling, local_theta = rope(path, config)
    fields.update(gemma2.sandwich_fields(path, config, llama.d_head(fields)), qk_norm=True,
                  rope_theta=theta, rope_scaling=scaling,
                  rope_local_theta=None if window[0] is None else local_theta)
    return llama.runnable(path, fields)


def text_config(path, config: dict) -> dict:
    """The ``text_config`` of an image-and-text Gemma 3 (``"model_type": "gemma3"``), with its
    head's tying: the outer config's ``tie_word_embeddings`` (Gemma3Config's default true), which
    the inner one, when it says, must agree with."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise TfmError(f"--load {path}: key 'text_config' is {shown(text)}, not the object an "
                       f"image-and-text Gemma 3's config.json holds its language model's "
                       f"config in")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if text.get("tie_word_embeddings", tied) != tied:
        raise TfmError(f"--load {path}: key 'tie_word_embeddings' is {shown(tied)} and "
                       f"text_config's {shown(text['tie_word_embeddings'])}; tfm will not guess "
                       f"which is meant")
    return {**text, "model_type": "gemma3_text", "tie_word_embeddings": tied}


def rope(path, config: dict):
    """(rope_theta, rope_scaling, rope_local_theta): Gemma 3's full-attention layers turn at
    ``rope_theta`` (1e6) with ``rope_scaling`` (4B and up: linear, 8), its sliding ones at
    ``rope_local_base_freq`` (10000), unscaled. transformers 5 writes both in
    ``rope_parameters``, one dict a layer type."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and set(parameters) & set(THETAS):
        key = "rope_parameters"
        full, sliding = (parameters.get(kind) or {} for kind in THETAS)
        names = [f"'rope_parameters' {kind}'s 'rope_theta'" for kind in THETAS]
        for kind, given in zip(THETAS, (full, sliding)):
            if not isinstance(given, dict):
                raise TfmError(f"--load {path}: key 'rope_parameters' has {kind} "
                               f"{shown(given)}, not an object (its rope_type and rope_theta)")
    else:   # the first configs' keys
        key = "rope_scaling"
        scaling = config.get(key) or {}
        if not isinstance(scaling, dict):
            raise TfmError(f"--load {path}: key 'rope_scaling' is {shown(scaling)}, not an "
                           f"object (its rope_type and numbers)")
        full = {**scaling, "rope_theta": config.get("rope_theta")}
        sliding = {"rope_theta": config.get("rope_local_base_freq")}
        names = ["'rope_theta'", "'rope_local_base_freq'"]
    if llama.read_scaling(path, key, sliding) is not None:
        raise TfmError(f"--load {path}: key {key!r} scales the sliding layers' angles "
                       f"({shown(sliding.get('rope_type'))}); tfm turns them by RoPE's own")
    thetas = []
    for kind, given, name in zip(THETAS, (full, sliding), names):
        raw = THETAS[kind] if given.get("rope_theta") is None else given["rope_theta"]
        theta = number(path, f"key {name}", raw)
        if theta <= 0:
            raise TfmError(f"--load {path}: key {name} is {shown(raw)}, not a positive number")
        thetas.append(theta)
    return thetas[0], llama.read_scaling(path, key, full), thetas[1]



def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, each norm's gamma ``1 + weight``; of an
    image-and-text folder, its language model's."""
    return gemma.load_params(folder, fields, dtype, checkpoint=NAME,
                             text_part=read_json(folder)[1].get("model_type") == "gemma3")


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``gemma.lazy_params``); of an image-and-text
    folder, its language model's."""
    return gemma.lazy_params(folder, fields, dtype, checkpoint=NAME,
                             text_part=read_json(folder)[1].get("model_type") == "gemma3")


from_tfm = gemma.from_tfm
