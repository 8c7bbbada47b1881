"""Qwen2 checkpoint folders (``"model_type": "qwen2"``: Qwen2, Qwen2.5): LLaMA's names, files
and model (``sources.llama`` reads them), with biases on attention's q, k and v projections
and nowhere else (``Config.qkv_bias``). A sliding window is read when every layer has it
(``use_sliding_window`` with ``max_window_layers`` 0); some layers sliding is refused."""

from __future__ import annotations

import functools

from tfmcli.sources import llama

NAME = "Qwen2"
read_config = llama.read_config
load_params = functools.partial(llama.load_params, checkpoint=NAME)
