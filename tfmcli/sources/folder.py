"""Checkpoint folders as Hugging Face's ``save_pretrained`` writes them and the hub serves them:
``config.json``'s ``model_type`` says whose names the weights carry (``sources.gpt2``,
``sources.llama``, ``sources.mistral``, ``sources.qwen2``, ``sources.qwen3``,
``sources.gemma``, ``sources.gemma2``, ``sources.gemma3``, ``sources.phi3``,
``sources.stablelm``, ``sources.gpt_neox``, ``sources.phi``, ``sources.gptj``,
``sources.codegen``, ``sources.opt``, ``sources.falcon``, ``sources.gpt_bigcode``,
``sources.bloom``, ``sources.mpt``), and each
of those modules reads its own."""

from __future__ import annotations

import json
from pathlib import Path

from tfmcli.errors import TfmError

CONFIG = "config.json"
MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
               "gemma3", "phi3", "stablelm", "gpt_neox", "phi", "gptj",
               "codegen", "opt", "falcon", "gpt_bigcode", "bloom", "mpt")


def read_json(folder) -> tuple[Path, dict]:
    """(its path, the object) of the folder's ``config.json``; TfmError naming the file."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise TfmError(f"--load {folder}: no {CONFIG} there (a checkpoint folder holds {CONFIG} "
                       f"and model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise TfmError(f"--load {path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise TfmError(f"--load {path}: not a JSON object")
    return path, config


def model_type(folder, config: dict | None = None) -> str:
    """The folder's ``model_type``, one tfm reads; TfmError otherwise."""
    if config is None:
        path, config = read_json(folder)
    else:
        path = Path(folder) / CONFIG
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        known = [repr(t) for t in MODEL_TYPES]
        raise TfmError(f"--load {path}: key 'model_type' is {kind!r}; tfm reads "
                       f"{', '.join(known[:-1])} and {known[-1]} checkpoints")
    return kind


def checkpoint_module(folder):
    """The module that reads this folder (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
    ``gemma``, ``gemma2``, ``gemma3``, ``phi3``, ``stablelm``, ``gpt_neox``, ``phi``, ``gptj``,
    ``codegen``, ``opt``, ``falcon``, ``gpt_bigcode``, ``bloom`` or ``mpt``): its ``NAME``, and
    ``read_config(folder)`` and ``load_params(folder, fields, dtype)``."""
    from tfmcli.sources import (
        bloom,
        codegen,
        falcon,
        gemma,
        gemma2,
        gemma3,
        gpt2,
        gpt_bigcode,
        gpt_neox,
        gptj,
        llama,
        mistral,
        mpt,
        opt,
        phi,
        phi3,
        qwen2,
        qwen3,
        stablelm,
    )

    return {"gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2,
            "qwen3": qwen3, "gemma": gemma, "gemma2": gemma2,
            "gemma3_text": gemma3, "gemma3": gemma3, "phi3": phi3,
            "stablelm": stablelm, "gpt_neox": gpt_neox, "phi": phi,
            "gptj": gptj, "codegen": codegen, "opt": opt,
            "falcon": falcon, "gpt_bigcode": gpt_bigcode, "bloom": bloom,
            "mpt": mpt}[model_type(folder)]


def need(path, config: dict, key: str, kind=int):
    """``config[key]``, which must be there and of ``kind`` (never a bool)."""
    value = config.get(key)
    if value is None:
        raise TfmError(f"--load {path}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "number" if kind == (int, float) else {int: "whole number"}.get(kind, kind.__name__)
        raise TfmError(f"--load {path}: key {key!r} is {value!r}, not a {what}")
    return value
