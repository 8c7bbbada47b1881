"""Qwen3 checkpoint folders (``"model_type": "qwen3"``: Qwen3 0.6B to 32B): LLaMA's names,
files and model (``sources.llama`` reads them), with heads of their own width (``head_dim``,
128 in every Qwen3) and each head's queries and keys normalised by RMSNorm before RoPE
(``Config.qk_norm``: ``self_attn.q_norm`` and ``k_norm`` map to ``attn.q_norm.gamma`` and
``attn.k_norm.gamma``). No biases (``attention_bias`` true, which puts one on ``o_proj`` as
well and none in the MLP, is refused). The sliding window is Qwen2's."""

from __future__ import annotations

import functools

from tfmcli.sources import llama, qwen2

NAME = "Qwen3"


def read_config(folder) -> dict:
    """Qwen2's keys and window, with no biases (``attention_bias`` refused), heads 128 wide when
    ``head_dim`` is left out and each head's queries and keys normalised (``Config.qk_norm``)."""
    path, config = llama.config_of(folder, "qwen3", NAME)
    fields = llama.read_fields(path, config, llama.no_attention_bias(path, config, NAME),
                               kv_heads=32, head_dim=128, window=qwen2.qwen_window(path, config))
    return llama.runnable(path, {**fields, "qk_norm": True})

load_params = functools.partial(llama.load_params, checkpoint=NAME)
lazy_params = functools.partial(llama.lazy_params, checkpoint=NAME)
