"""Phi-3 checkpoint folders (``"model_type": "phi3"``: Phi-3 mini and medium with the 4k
context, Phi-4): LLaMA's model and files (``sources.llama`` reads them), with two of each
layer's weights stored fused, each read once and split along its rows:

    model.layers.{i}.self_attn.qkv_proj -> attn.W_Q, W_K, W_V   (rows: H, H_kv, H_kv heads)
    model.layers.{i}.mlp.gate_up_proj -> ffn.W_gate, W_1        (rows: d_ff, then d_ff)

The rest is LLaMA's names. No biases (Hugging Face's Phi-3 has none), RMSNorm's epsilon 1e-5
when config.json has none (Phi3Config's), and a sliding window in every layer when
``sliding_window`` is set (Phi-3 mini 4k: 2047, each query seeing itself and the 2046 keys
before it). A ``partial_rotary_factor`` under 1 turns only the first ``factor * d_head``
dimensions of each head (``Config.rotary_dim``). Refused: the long-context models' ``longrope``
scaling (Phi-3 128k, Phi-3.5, Phi-4-mini), whose per-pair factors change with the length and
whose cos and sin are scaled too.
"""

from __future__ import annotations

import functools

from tfmcli.sources import llama

NAME = "Phi-3"


def read_config(folder) -> dict:
    """LLaMA's keys, never biased, RMSNorm's epsilon 1e-5 when left out (Phi3Config's), the
    window of ``sliding_window`` in every layer, and RoPE on part of each head when
    ``partial_rotary_factor`` says (``Config.rotary_dim``)."""
    path, config = llama.config_of(folder, "phi3", NAME, defaults={"rms_norm_eps": 1e-5})
    window = llama.sliding(path, config, config.get("sliding_window"), llama.every,
                           every_layer=NAME)
    fields = llama.read_fields(path, config, (False, False, False), window=window)
    rotary_dim = llama.read_rotary_dim(path, config, llama.d_head(fields))
    return llama.runnable(path, {**fields, "rotary_dim": rotary_dim})

load_params = functools.partial(llama.load_params, checkpoint=NAME, fused=True)
lazy_params = functools.partial(llama.lazy_params, checkpoint=NAME, fused=True)
name_map = functools.partial(llama.name_map, fused=True)
from_tfm = functools.partial(llama.from_tfm, fused=True)
