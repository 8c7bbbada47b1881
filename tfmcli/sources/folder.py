"""Checkpoint folders as Hugging Face's ``save_pretrained`` writes them and the hub serves them:
the helpers every family's reader shares: a file of the folder (``inside``: never one outside
it), a JSON file read, ``config.json`` read, and a key that must be there and what it may be.
Which reader reads a folder is ``sources.families``'."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tfmcli.errors import TfmError

CONFIG = "config.json"
LARGEST = 2**31 - 1   # a size's ceiling in a config.json: the CLI's own (cli.options.LARGEST)


def inside(folder, name: str, named_by=None) -> Path:
    """The folder's file ``name`` (``folder / name``), when it is inside the folder through
    every link (the folder's own resolved, then the file's): a checkpoint folder reads its own
    files and no other, whatever an index names (``named_by``: the file that names it) or a
    symlink points to. TfmError naming the file otherwise."""
    path = Path(folder) / name
    try:
        root, real = Path(folder).resolve(), path.resolve()
    except (OSError, RuntimeError) as e:   # a loop of links (RuntimeError before Python 3.13)
        raise TfmError(f"--load {path}: cannot follow its links ({e})") from None
    if real == root or root in real.parents:
        return path
    written = Path(os.path.normpath(Path(folder).absolute() / name))   # (no link followed)
    if named_by is not None and not written.is_relative_to(Path(folder).absolute()):
        raise TfmError(f"--load {named_by}: names {shown(name, 4096)}, which is outside "
                       f"{folder}; a checkpoint folder reads only the files inside it")
    raise TfmError(f"--load {path}: a link to {real}, which is outside {folder}; a checkpoint "
                   f"folder reads only the files inside it (copy the file in)")


def load_json(path):
    """The JSON value of the file at ``path``; TfmError naming it when it cannot be read or is
    not JSON (nested too deeply for Python's parser included)."""
    try:
        return json.loads(Path(path).read_bytes())
    except OSError as e:
        raise TfmError(f"--load {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TfmError(f"--load {path}: not JSON ({e})") from None
    except RecursionError:
        raise TfmError(f"--load {path}: not JSON tfm reads (nested too deeply)") from None


def read_json(folder) -> tuple[Path, dict]:
    """(its path, the object) of the folder's ``config.json``; TfmError naming the file."""
    path = inside(folder, CONFIG)
    if not path.is_file():
        raise TfmError(f"--load {folder}: no {CONFIG} there (a checkpoint folder holds {CONFIG} "
                       f"and model.safetensors)")
    config = load_json(path)
    if not isinstance(config, dict):
        raise TfmError(f"--load {path}: not a JSON object")
    return path, config


def shown(value, most: int = 60) -> str:
    """A value as an error line shows it: its repr, cut after ``most`` characters (a key may
    hold a list of a million entries, or an integer of 400 digits)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):   # nested too deeply; an int past 4300 digits
        text = f"a {type(value).__name__} too large to show"
    return text if len(text) <= most else f"{text[:most]}... ({len(text):,} characters)"


def known(value, allowed) -> bool:
    """Is ``value`` one of the strings ``allowed`` (a tuple or a dict's keys)? False for a
    list or an object (which a dict's lookup cannot even hash)."""
    return isinstance(value, str) and value in allowed


def need(path, config: dict, key: str, kind=int):
    """``config[key]``, which must be there: a size (``kind`` int), a whole number in
    1..``LARGEST``; or a number (``kind`` (int, float)), finite (an integer past float's range
    is not). Never a bool."""
    value = config.get(key)
    if value is None:
        raise TfmError(f"--load {path}: missing key {key!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TfmError(f"--load {path}: key {key!r} is {shown(value)}, not a whole number")
        if not 1 <= value <= LARGEST:
            raise TfmError(f"--load {path}: key {key!r} is {shown(value)}, not a whole number "
                           f"in 1..{LARGEST}")
        return value
    return number(path, f"key {key!r}", value)


def number(path, where: str, value) -> float:
    """``value`` as a float: a JSON number, finite (NaN, Infinity and an integer past float's
    range refused); TfmError naming the file at ``path`` and ``where`` the value is ("key
    'rms_norm_eps'") otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TfmError(f"--load {path}: {where} is {shown(value)}, not a number")
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise TfmError(f"--load {path}: {where} is {shown(value)}, not a finite number")
    return float(value)


def one_line(error: BaseException, most: int = 200) -> str:
    """An exception's message on one line (a package's may span several), cut after ``most``
    characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= most else text[:most] + "..."
