"""Mistral checkpoint folders (``"model_type": "mistral"``: Mistral 7B v0.1-v0.3 and models of
its shape): LLaMA's names, files and model (``sources.llama`` reads them), with the sliding
window of ``sliding_window`` when the config sets one (``Config.sliding_window``; Mistral 7B
v0.1: 4096)."""

from __future__ import annotations

import functools

from tfmcli.sources import llama

NAME = "Mistral"
read_config = llama.read_config
load_params = functools.partial(llama.load_params, checkpoint=NAME)
