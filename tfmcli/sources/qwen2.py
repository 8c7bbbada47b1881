"""Qwen2 checkpoint folders (``"model_type": "qwen2"``: Qwen2, Qwen2.5): LLaMA's names, files
and model (``sources.llama`` reads them), with biases on attention's q, k and v projections
and nowhere else (``Config.qkv_bias``). A sliding window is read with ``use_sliding_window``,
in the layers from ``max_window_layers`` on."""

from __future__ import annotations

import functools

from tfmcli.errors import TfmError
from tfmcli.sources import llama
from tfmcli.sources.folder import shown

NAME = "Qwen2"


def qwen_window(path, config: dict) -> tuple:
    """Qwen2's and Qwen3's window: ``sliding_window`` only with ``use_sliding_window`` (Hugging
    Face's Qwen2Config drops it otherwise), in the layers from ``max_window_layers`` (28 when
    left out) on."""
    def from_max_window_layers(layers: int) -> list[int]:
        first = config.get("max_window_layers", 28)   # Hugging Face's default
        if isinstance(first, bool) or not isinstance(first, int):
            raise TfmError(f"--load {path}: key 'max_window_layers' is {shown(first)}, not a "
                           f"number")
        return list(range(max(first, 0), layers))

    if not llama.switch(path, config, "use_sliding_window"):
        return None, None
    return llama.sliding(path, config, config.get("sliding_window"), from_max_window_layers)


def read_config(folder) -> dict:
    """LLaMA's keys, biases on q, k and v alone, 32 key/value heads when
    ``num_key_value_heads`` is left out (Qwen2Config's default), and its window."""
    path, config = llama.config_of(folder, "qwen2", NAME)
    return llama.runnable(path, llama.read_fields(path, config, (False, True, False),
                                                  kv_heads=32, window=qwen_window(path, config)))

load_params = functools.partial(llama.load_params, checkpoint=NAME)
lazy_params = functools.partial(llama.lazy_params, checkpoint=NAME)
