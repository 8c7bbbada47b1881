"""Checkpoint folders as Hugging Face's ``save_pretrained`` writes them and the hub serves them:
the helpers every family's reader shares (``config.json`` read, a key that must be there).
Which reader reads a folder is ``sources.families``'."""

from __future__ import annotations

import json
from pathlib import Path

from tfmcli.errors import TfmError

CONFIG = "config.json"
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


def need(path, config: dict, key: str, kind=int):
    """``config[key]``, which must be there and of ``kind`` (never a bool)."""
    value = config.get(key)
    if value is None:
        raise TfmError(f"--load {path}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "number" if kind == (int, float) else {int: "whole number"}.get(kind, kind.__name__)
        raise TfmError(f"--load {path}: key {key!r} is {value!r}, not a {what}")
    return value
