"""Runs in and out: the ``.npz`` layout, atomic saving, checked loading, and JSON-ready values.

The ``.npz`` layout (NumPy's own format, readable with ``allow_pickle=False``)::

    param/<name>     every parameter            grad/<name>     its gradient
    act/<name>       every named activation     actgrad/<name>  d loss / d activation
    input/tokens (B, T)   input/targets (B, T)   input/lengths (B,)
    loss             0-d float                  config          0-d str: JSON of the Config
"""

from __future__ import annotations

import math
import os
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tfmcli.config import Config, param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.model import Forward, Gradients, Inputs

SECTIONS = ("param/", "grad/", "act/", "actgrad/")
INPUT_KEYS = ("input/tokens", "input/targets", "input/lengths")


def run_arrays(cfg: Config, params: dict, inputs: Inputs, fwd: Forward | None = None,
               grads: Gradients | None = None) -> dict[str, np.ndarray]:
    """Everything of a run as flat ``npz`` keys."""
    arrays = {f"param/{name}": value for name, value in params.items()}
    arrays.update({"input/tokens": inputs.tokens, "input/targets": inputs.targets,
                   "input/lengths": inputs.lengths, "config": np.array(cfg.to_json())})
    if fwd is not None:
        arrays.update({f"act/{name}": value for name, value in fwd.acts.items()})
        arrays["loss"] = np.array(fwd.loss, dtype=cfg.np_dtype)
    if grads is not None:
        arrays.update({f"grad/{name}": value for name, value in grads.items()})
        arrays.update({f"actgrad/{name}": value for name, value in grads.acts.items()})
    return arrays


@contextmanager
def atomic_write(path: str | os.PathLike):
    """Yield a binary file in ``path``'s folder; rename it over ``path`` only if the block succeeds.

    An interrupted or failed write leaves no file behind, and an existing ``path`` untouched.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise TfmError(f"cannot write {path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_npz(path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed ``.npz``, atomically."""
    try:
        with atomic_write(path) as f:
            np.savez(f, **arrays)
    except OSError as e:
        raise TfmError(f"cannot write {path}: {e.strerror or e}") from None


def save_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (used for ``--svg``)."""
    try:
        with atomic_write(path) as f:
            f.write(text.encode("utf-8"))
    except OSError as e:
        raise TfmError(f"cannot write {path}: {e.strerror or e}") from None


# ---------------------------------------------------------------- loading


class LoadedRun(NamedTuple):
    fields: dict               # Config fields the file decides (from its config, or its shapes)
    params: dict               # name -> ndarray, checked against the config
    inputs: Inputs | None      # when the file has input/*
    has_config: bool


def read_npz(path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz``, loaded with ``allow_pickle=False``."""
    path = Path(path)
    if not path.is_file():
        raise TfmError(f"--load {path}: no such file")
    if not zipfile.is_zipfile(path):
        raise TfmError(f"--load {path}: not an .npz file (it is not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as e:
        raise TfmError(f"--load {path}: an array needs pickle, which tfm never loads ({e})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise TfmError(f"--load {path}: cannot read the archive ({e})") from None


def _infer_fields(path, arrays: dict) -> dict:
    """Sizes a file without a ``config`` key fixes through its shapes."""
    W_E = arrays.get("param/embed.W_E")
    if W_E is None or W_E.ndim != 2:
        raise TfmError(f"--load {path}: missing key 'param/embed.W_E' (needed to learn vocab, d_model)")
    fields = {"vocab": int(W_E.shape[0]), "d_model": int(W_E.shape[1]), "dtype": str(W_E.dtype)}
    blocks = {key.split(".")[1] for key in arrays if key.startswith("param/blocks.")}
    fields["layers"] = len(blocks)
    W_1 = arrays.get("param/blocks.0.ffn.W_1")
    if W_1 is not None and W_1.ndim == 2:
        fields["d_ff"] = int(W_1.shape[1])
    fields["norm"] = "pre" if "param/ln_f.gamma" in arrays else "post"
    return fields


def load_run(path) -> LoadedRun:
    """Read a run saved by ``--save`` (or made elsewhere in the same layout), unchecked sizes aside.

    Call ``check_run`` with the final Config to validate every array against it.
    """
    arrays = read_npz(path)
    if "config" in arrays:
        try:
            fields = Config.fields_from_json(str(arrays["config"][()]))
        except ConfigError as e:
            raise TfmError(f"--load {path}: key 'config' has an {e}") from None
        except ValueError as e:
            raise TfmError(f"--load {path}: key 'config' is not a JSON object ({e})") from None
        has_config = True
    else:
        fields = _infer_fields(path, arrays)
        has_config = False
    params = {key[len("param/"):]: value for key, value in arrays.items() if key.startswith("param/")}
    inputs = None
    present = [key for key in INPUT_KEYS if key in arrays]
    if present:
        missing = [key for key in INPUT_KEYS if key not in arrays]
        if missing:
            raise TfmError(f"--load {path}: has {present[0]!r} but is missing key {missing[0]!r}")
        tokens, targets, lengths = (arrays[key] for key in INPUT_KEYS)
        inputs = Inputs(tokens, targets, lengths)
        if tokens.ndim == 2 and not has_config:
            fields["batch"], fields["seq_len"] = int(tokens.shape[0]), int(tokens.shape[1])
            if lengths.ndim == 1 and lengths.dtype.kind in "iu":
                full = bool(np.all(lengths == tokens.shape[1]))
                fields["lengths"] = None if full else tuple(int(n) for n in lengths)
    _check_keys(path, arrays)
    return LoadedRun(fields, params, inputs, has_config)


def _check_keys(path, arrays):
    for key in arrays:
        if key in ("config", "loss") or key in INPUT_KEYS:
            continue
        if not any(key.startswith(s) and len(key) > len(s) for s in SECTIONS):
            raise TfmError(f"--load {path}: unknown key {key!r} (allowed: param/, grad/, act/, "
                           f"actgrad/, input/tokens, input/targets, input/lengths, loss, config)")


def check_run(path, run: LoadedRun, cfg: Config) -> tuple[dict, Inputs | None]:
    """Validate a loaded run against ``cfg``: every key, shape, dtype and value.

    Returns the parameters and inputs ready for ``forward``. Each failure names the key.
    """
    expected = param_shapes(cfg)
    for name in expected:
        if name not in run.params:
            raise TfmError(f"--load {path}: missing key 'param/{name}'")
    for name, value in run.params.items():
        key = f"param/{name}"
        if name not in expected:
            raise TfmError(f"--load {path}: unknown key {key!r} (not a parameter of this model)")
        if value.shape != expected[name]:
            raise TfmError(f"--load {path}: {key} has shape {value.shape}, expected {expected[name]}")
        if value.dtype != cfg.np_dtype:
            raise TfmError(f"--load {path}: {key} has dtype {value.dtype}, expected {cfg.dtype}")
        if not np.all(np.isfinite(value)):
            raise TfmError(f"--load {path}: {key} contains NaN or Inf")
    if run.inputs is None:
        return run.params, None
    B, T, V = cfg.batch, cfg.seq_len, cfg.vocab
    for key, value, shape in (("input/tokens", run.inputs.tokens, (B, T)),
                              ("input/targets", run.inputs.targets, (B, T)),
                              ("input/lengths", run.inputs.lengths, (B,))):
        if value.dtype.kind not in "iu":
            raise TfmError(f"--load {path}: {key} has dtype {value.dtype}, expected integers")
        if value.shape != shape:
            raise TfmError(f"--load {path}: {key} has shape {value.shape}, expected {shape}")
    for key, value, low, high in (("input/tokens", run.inputs.tokens, 0, V - 1),
                                  ("input/targets", run.inputs.targets, 0, V - 1),
                                  ("input/lengths", run.inputs.lengths, 1, T)):
        if value.size and (value.min() < low or value.max() > high):
            raise TfmError(f"--load {path}: {key} has values outside {low}..{high}")
    if not np.array_equal(run.inputs.lengths, cfg.lengths_array()):
        raise TfmError(f"--load {path}: input/lengths {run.inputs.lengths.tolist()} "
                       f"disagrees with the config's lengths {cfg.lengths_array().tolist()}")
    inputs = Inputs(*(value.astype(np.int64) for value in run.inputs))
    return run.params, inputs


def config_for_load(path, run: LoadedRun, flags: dict, explicit: set[str]) -> Config:
    """The Config of a loaded run: the file's fields, then flags the file does not decide.

    ``flags`` holds every Config field as the CLI would set it; ``explicit`` names the fields
    the user typed. A typed flag that contradicts the file is an error, never silently ignored.
    """
    fields = dict(run.fields)
    for name in explicit:
        if name in fields and fields[name] != flags[name]:
            raise ConfigError(name, f"{name}={flags[name]!r} contradicts {path}, which has "
                                    f"{name}={fields[name]!r}; drop the flag or change the file")
    merged = {**flags, **fields}
    try:
        return Config(**merged)
    except TypeError as e:
        raise TfmError(f"--load {path}: key 'config' does not describe a run ({e})") from None


# ---------------------------------------------------------------- JSON


def jsonable(array: np.ndarray):
    """Nested lists for JSON; -inf (a hidden attention score) and NaN become null."""
    array = np.asarray(array)
    if array.dtype.kind == "b":
        return array.tolist()
    if array.dtype.kind in "iu":
        return array.tolist()

    def clean(value):
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value if math.isfinite(value) else None

    return clean(array.astype(np.float64).tolist())
