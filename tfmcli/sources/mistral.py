"""Mistral checkpoint folders (``"model_type": "mistral"``: Mistral 7B v0.1-v0.3 and models of
its shape): LLaMA's names, files and model (``sources.llama`` reads them), with the sliding
window of ``sliding_window`` when the config sets one (``Config.sliding_window``; Mistral 7B
v0.1: 4096)."""

from __future__ import annotations

import functools

from tfmcli.sources import llama

NAME = "Mistral"


def read_config(folder) -> dict:
    """LLaMA's keys, 8 key/value heads when ``num_key_value_heads`` is left out (MistralConfig's
    default), and the window of ``sliding_window`` in every layer."""
    path, config = llama.config_of(folder, "mistral", NAME)
    window = llama.sliding(path, config, config.get("sliding_window"), llama.every,
                           every_layer=NAME)
    return llama.runnable(path, llama.read_fields(path, config, llama.biases(path, config),
                                                  kv_heads=8, window=window))

load_params = functools.partial(llama.load_params, checkpoint=NAME)
lazy_params = functools.partial(llama.lazy_params, checkpoint=NAME)
