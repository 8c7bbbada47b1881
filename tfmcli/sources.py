"""Where a run comes from: the weights from a seed or a file, the tokens from a seed, a file or
``--tokens``. Every source becomes the same :class:`Run`, so each command asks here once.

``resolve`` decides the Config and reads what a file holds without drawing anything; the
caller can then refuse a run too big for memory before ``Run.complete`` allocates the rest.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tfmcli.config import Config, param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.init import init_params
from tfmcli.model import IGNORE, Inputs, inputs_from_tokens, make_inputs

SECTIONS = ("param/", "grad/", "act/", "actgrad/")
INPUT_KEYS = ("input/tokens", "input/targets", "input/lengths")
INPUT_FIELDS = ("batch", "seq_len", "lengths")  # Config fields the tokens decide
PAD_LABEL = "pad"


@dataclass
class Run:
    """A run's Config, parameters and inputs, and where each came from.

    ``params`` and ``inputs`` are None until :meth:`complete` draws them from the seed.
    """

    cfg: Config
    params: dict | None
    inputs: Inputs | None
    weights_from: str   # "seed 1000 (xavier init)", "file run.npz"
    tokens_from: str    # "seed 1000", "--tokens", "file run.npz"

    def complete(self) -> "Run":
        if self.params is None:
            self.params = init_params(self.cfg)
        if self.inputs is None:
            self.inputs = make_inputs(self.cfg)
        return self

    def token_labels(self, row: int) -> list[str]:
        """One label per position of batch row ``row``: the token id, or 'pad' past its length."""
        tokens, length = self.inputs.tokens[row], int(self.inputs.lengths[row])
        return [str(int(t)) if i < length else PAD_LABEL for i, t in enumerate(tokens)]

    def target_labels(self, row: int) -> list[str]:
        """The target of each position of row ``row``; '—' where there is none."""
        targets, length = self.inputs.targets[row], int(self.inputs.lengths[row])
        return [str(int(t)) if i < length and t != IGNORE else "—" for i, t in enumerate(targets)]


def resolve(flags: dict, explicit: set[str], load=None, tokens=None) -> Run:
    """The run that command-line style settings describe.

    Parameters
    ----------
    flags : dict
        Every Config field as the command line sets it (typed or default).
    explicit : set of str
        The fields the user typed; a typed value that a file or the tokens contradict is an
        error, never silently overridden.
    load : path, optional
        An ``.npz`` in tfm's layout: its parameters, and its inputs unless ``tokens`` are given.
    tokens : list of list of int, optional
        The input ids, one list per batch row (see ``model.inputs_from_tokens``).

    Raises
    ------
    ConfigError
        A setting is out of range or contradicts the file or the tokens (``field`` names it).
    TfmError
        The file cannot be read or does not describe a run.
    """
    fields, params, inputs = {}, None, None
    weights_from = tokens_from = None
    if load is not None:
        loaded = load_npz(load)
        fields, params, inputs = dict(loaded.fields), loaded.params, loaded.inputs
        weights_from = f"file {load}"
        tokens_from = f"file {load}" if inputs is not None else None
    for name in explicit:
        if name in fields and fields[name] != flags[name] and not (tokens and name in INPUT_FIELDS):
            raise ConfigError(name, f"{name}={flags[name]!r} contradicts {load}, which has "
                                    f"{name}={fields[name]!r}; drop the flag or change the file")
    if tokens is not None:
        inputs = inputs_from_tokens(tokens)
        _check_against_tokens(flags, explicit, inputs)
        B, T = inputs.tokens.shape
        full = bool(np.all(inputs.lengths == T))
        # the tokens replace a file's inputs, and with them its batch, seq_len and lengths
        fields.update(batch=B, seq_len=T,
                      lengths=None if full else tuple(int(n) for n in inputs.lengths))
        tokens_from = "--tokens"
    try:
        cfg = Config(**{**flags, **fields})
    except TypeError as e:
        raise TfmError(f"--load {load}: key 'config' does not describe a run ({e})") from None
    if tokens is not None:
        _check_ids(inputs, cfg)
    if load is not None:
        params = check_params(load, params, cfg)
        if tokens is None:
            inputs = check_inputs(load, inputs, cfg)
    seed = f"seed {cfg.seed}"
    return Run(cfg, params, inputs, weights_from or f"{seed} ({cfg.init} init)",
               tokens_from or seed)


def parse_tokens(texts) -> list[list[int]] | None:
    """['3,1,4', '1,5'] -> [[3, 1, 4], [1, 5]]; ValueError naming the text that is not ids."""
    if not texts:
        return None
    rows = []
    for text in texts:
        try:
            rows.append([int(part) for part in text.split(",")])
        except ValueError:
            raise ConfigError("tokens", f"{text!r} is not a comma-separated list of token ids "
                                        f"(like 3,1,4,1,5)") from None
    if all(len(row) == 1 for row in rows):
        raise ConfigError("tokens", "no position has a next token to predict: give at least "
                                    "one row of two or more ids")
    return rows


def _check_against_tokens(flags, explicit, inputs):
    B, T = inputs.tokens.shape
    lengths = [int(n) for n in inputs.lengths]
    given = {"batch": (B, f"which gives {B} row{'s' * (B > 1)}"),
             "seq_len": (T, f"whose longest row has {T} tokens"),
             "lengths": (tuple(lengths), f"whose rows have lengths {','.join(map(str, lengths))}")}
    for name, (value, why) in given.items():
        if name in explicit and flags[name] != value:
            typed = flags[name]
            typed = ",".join(map(str, typed)) if isinstance(typed, tuple) else typed
            raise ConfigError(name, f"{name}={typed} contradicts --tokens, {why}")


def _check_ids(inputs, cfg):
    real = inputs.tokens[np.arange(inputs.tokens.shape[1])[None, :] < inputs.lengths[:, None]]
    bad = real[(real < 0) | (real >= cfg.vocab)]
    if bad.size:
        raise ConfigError("tokens", f"id {int(bad[0])} is outside 0..{cfg.vocab - 1} "
                                    f"(--vocab {cfg.vocab})")


# ---------------------------------------------------------------- .npz files


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
    W_pos = arrays.get("param/embed.W_pos")
    if W_pos is not None and W_pos.ndim == 2:
        fields["pe"], fields["n_ctx"] = "learned", int(W_pos.shape[0])
    fields["tied_head"] = "param/head.W_U" not in arrays
    fields["head_bias"] = "param/head.b_U" in arrays
    return fields


def load_npz(path) -> LoadedRun:
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


def check_params(path, params: dict, cfg: Config) -> dict:
    """Every parameter ``cfg`` needs, of its shape and dtype, finite, and no other; each failure
    names the key."""
    expected = param_shapes(cfg)
    for name in expected:
        if name not in params:
            raise TfmError(f"--load {path}: missing key 'param/{name}'")
    for name, value in params.items():
        key = f"param/{name}"
        if name not in expected:
            raise TfmError(f"--load {path}: unknown key {key!r} (not a parameter of this model)")
        if value.shape != expected[name]:
            raise TfmError(f"--load {path}: {key} has shape {value.shape}, expected {expected[name]}")
        if value.dtype != cfg.np_dtype:
            raise TfmError(f"--load {path}: {key} has dtype {value.dtype}, expected {cfg.dtype}")
        if not np.all(np.isfinite(value)):
            raise TfmError(f"--load {path}: {key} contains NaN or Inf")
    return params


def check_inputs(path, inputs: Inputs | None, cfg: Config) -> Inputs | None:
    """A file's inputs checked against ``cfg`` (shapes, ranges, lengths), as int64."""
    if inputs is None:
        return None
    B, T, V = cfg.batch, cfg.seq_len, cfg.vocab
    for key, value, shape in (("input/tokens", inputs.tokens, (B, T)),
                              ("input/targets", inputs.targets, (B, T)),
                              ("input/lengths", inputs.lengths, (B,))):
        if value.dtype.kind not in "iu":
            raise TfmError(f"--load {path}: {key} has dtype {value.dtype}, expected integers")
        if value.shape != shape:
            raise TfmError(f"--load {path}: {key} has shape {value.shape}, expected {shape}")
    targets = inputs.targets[inputs.targets != IGNORE]  # -100: no target there
    for key, value, low, high in (("input/tokens", inputs.tokens, 0, V - 1),
                                  ("input/targets", targets, 0, V - 1),
                                  ("input/lengths", inputs.lengths, 1, T)):
        if value.size and (value.min() < low or value.max() > high):
            extra = f" (or {IGNORE}: no target)" if key == "input/targets" else ""
            raise TfmError(f"--load {path}: {key} has values outside {low}..{high}{extra}")
    if not np.array_equal(inputs.lengths, cfg.lengths_array()):
        raise TfmError(f"--load {path}: input/lengths {inputs.lengths.tolist()} "
                       f"disagrees with the config's lengths {cfg.lengths_array().tolist()}")
    inputs = Inputs(*(value.astype(np.int64) for value in inputs))
    valid = (np.arange(T)[None, :] < inputs.lengths[:, None]) & (inputs.targets != IGNORE)
    if not valid.any():
        raise TfmError(f"--load {path}: input/targets has no target inside the lengths "
                       f"(every one is {IGNORE})")
    return inputs
