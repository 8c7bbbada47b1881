"""Which module reads a checkpoint folder: ``config.json``'s ``model_type`` names its family,
and each family's module (``sources.gpt2``, ``sources.llama``, ...) reads its own keys and
weights, reusing its parent family's reader (Mistral's is LLaMA's, CodeGen's GPT-J's, ...).

The readers import ``sources.folder`` (the file helpers) and their parents, never this module:
the registry imports a reader by name when a folder asks for it, so a command that reads no
folder imports none.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tfmcli.errors import TfmError
from tfmcli.sources.folder import CONFIG, known, read_json, shown

# model_type -> the module that reads it, in the order tfm learned them
MODEL_TYPES = {
    "gpt2": "gpt2", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3",
    "phi3": "phi3", "stablelm": "stablelm", "gpt_neox": "gpt_neox", "phi": "phi",
    "gptj": "gptj", "codegen": "codegen", "opt": "opt", "falcon": "falcon",
    "gpt_bigcode": "gpt_bigcode", "bloom": "bloom", "mpt": "mpt",
}


def model_type(folder, config: dict | None = None) -> str:
    """The folder's ``model_type``, one tfm reads; TfmError otherwise."""
    if config is None:
        path, config = read_json(folder)
    else:
        path = Path(folder) / CONFIG
    kind = config.get("model_type")
    if not known(kind, MODEL_TYPES):
        types = [repr(t) for t in MODEL_TYPES]
        raise TfmError(f"--load {path}: key 'model_type' is {shown(kind)}; tfm reads "
                       f"{', '.join(types[:-1])} and {types[-1]} checkpoints")
    return kind


def checkpoint_module(folder):
    """The module that reads this folder: its ``NAME``, and ``read_config(folder)`` and
    ``load_params(folder, fields, dtype)``."""
    return importlib.import_module(f"tfmcli.sources.{MODEL_TYPES[model_type(folder)]}")
