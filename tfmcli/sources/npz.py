"""Runs saved in tfm's ``.npz`` layout (``io.run_arrays``), read back and checked key by key."""

from __future__ import annotations

import math
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tfmcli.engine.config import GATED, Config
from tfmcli.engine.inputs import IGNORE, Inputs, first_outside
from tfmcli.engine.sizes import param_misfit
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources.folder import shown

SECTIONS = ("param/", "grad/", "act/", "actgrad/")
INPUT_KEYS = ("input/tokens", "input/targets", "input/lengths")


class LoadedRun(NamedTuple):
    fields: dict               # Config fields the file decides (from its config, or its shapes)
    params: dict               # name -> ndarray, checked against the config
    inputs: Inputs | None      # when the file has input/*
    has_config: bool
    task: dict | None = None   # tfm train's task: {"task": "reverse", "n": 8, "symbols": 10}
    interventions: tuple = ()  # what the saved run changed (its weights are as they were)


# how np.savez and np.savez_compressed store a member: the two methods tfm reads
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
# an .npy header's reader by its format version (3.0, for utf-8 field names, is read unchecked)
HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def read_npz(path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz``: a zip archive of ``.npy`` members, each stored or deflated
    (as NumPy writes them), none encrypted, read with ``allow_pickle=False``. TfmError naming
    the file (and the member) otherwise: never a traceback, and never an object NumPy would
    hand back for a member that is not an array (its raw bytes)."""
    path = Path(path)
    if not path.exists():
        raise TfmError(f"--load {path}: no such file")
    if not path.is_file():   # a device or a pipe: an archive is read by seeking
        raise TfmError(f"--load {path}: not a file (allowed: an .npz file or a checkpoint folder)")
    if not zipfile.is_zipfile(path):
        folder = path.resolve().parent
        if (folder / "config.json").is_file():   # a checkpoint folder's file: --load takes it whole
            raise TfmError(f"--load {path}: a file of the checkpoint folder {path.parent}; pass "
                           f"the folder (--load {path.parent})")
        raise TfmError(f"--load {path}: not an .npz file (not a zip archive, or one cut short)")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            for info in members:
                _check_member(path, info)
            return {info.filename[:-len(".npy")]: _read_member(path, archive, info)
                    for info in members}
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise TfmError(f"--load {path}: cannot read the archive ({e})") from None


def _check_member(path, info: zipfile.ZipInfo) -> None:
    """A member NumPy wrote: an ``.npy`` file, stored or deflated, not encrypted."""
    name = info.filename
    if not name.endswith(".npy") or name == ".npy":
        raise TfmError(f"--load {path}: member {shown(name)} is not an .npy array (an .npz "
                       f"holds .npy members alone, as np.savez writes them)")
    if info.flag_bits & 0x1:
        raise TfmError(f"--load {path}: member {shown(name)} is encrypted; tfm reads archives "
                       f"without a password, as np.savez writes them")
    if info.compress_type not in METHODS:
        method = zipfile.compressor_names.get(info.compress_type, f"method {info.compress_type}")
        raise TfmError(f"--load {path}: member {shown(name)} is compressed with {method}; tfm "
                       f"reads members stored or deflated (np.savez, np.savez_compressed)")


def _read_member(path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member, read with ``allow_pickle=False``, once its header's shape is known
    to fit the bytes the member holds (a header that claims more is refused before anything
    that size is allocated)."""
    name = info.filename
    try:
        with archive.open(info) as f:
            read_header = HEADERS.get(np.lib.format.read_magic(f))
            if read_header is not None:
                shape, _, dtype = read_header(f)
                need, have = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
                if not dtype.hasobject and need > have:
                    raise TfmError(f"--load {path}: member {shown(name)} is cut short: its "
                                   f"header says {shown(shape)} of {dtype}, {need:,} bytes, and it "
                                   f"holds {have:,}")
        with archive.open(info) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e):
            raise TfmError(f"--load {path}: an array needs pickle, which tfm never loads "
                           f"(member {shown(name)}: {e})") from None
        raise TfmError(f"--load {path}: member {shown(name)} is not an .npy array tfm reads "
                       f"({e})") from None
    except (SyntaxError, RecursionError, UnicodeDecodeError) as e:   # its header's text
        raise TfmError(f"--load {path}: member {shown(name)} is not an .npy array tfm reads "
                       f"(its header: {type(e).__name__})") from None


def _infer_fields(path, arrays: dict) -> dict:
    """Sizes a file without a ``config`` key fixes through its shapes."""
    W_E = arrays.get("param/embed.W_E")
    if W_E is None or W_E.ndim != 2:
        raise TfmError(
            f"--load {path}: missing key 'param/embed.W_E' (needed to learn vocab, d_model)"
        )
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
    fields["bias"] = "param/blocks.0.attn.b_O" in arrays   # LLaMA's linear layers have none
    fields["qkv_bias"] = "param/blocks.0.attn.b_Q" in arrays and not fields["bias"]   # Qwen2
    fields["ffn_bias"] = "param/blocks.0.ffn.b_1" in arrays and not fields["bias"]   # GPT-J
    fields["rms_norm"] = ("param/blocks.0.ln1.gamma" in arrays
                          and "param/blocks.0.ln1.beta" not in arrays)
    fields["qk_norm"] = "param/blocks.0.attn.q_norm.gamma" in arrays   # Qwen3's
    fields["embed_norm"] = "param/ln_embed.gamma" in arrays   # BLOOM's
    return fields


def infer_activation(params: dict, fields: dict) -> dict:
    """A file without a ``config`` key: a gate (``ffn.W_gate``) makes the FFN gated, SwiGLU
    unless the activation given is GeGLU, which has the same weights (the file cannot tell the
    two apart); ``check_params`` names a gated activation given for a file with no gate."""
    if "blocks.0.ffn.W_gate" in params and fields.get("activation") not in GATED:
        return {"activation": "swiglu"}
    return {}


def infer_norm(fields: dict) -> dict:
    """A file without a ``config`` key whose norms have gamma alone: RMSNorm, unless the norms
    are given as layer norms without beta (``norm_bias`` false, MPT's), which have the same
    parameters (the file cannot tell the two apart)."""
    if fields.get("rms_norm") and fields.get("norm_bias") is False:
        return {"rms_norm": False}
    return {}


def infer_heads(params: dict, fields: dict) -> dict:
    """A file without a ``config`` key: the heads' sizes its shapes fix for the heads given (or
    the default). ``head_dim`` from W_Q's width when it is not d_model (H heads of W_Q's width /
    H), then ``kv_heads`` from W_K's width when it is narrower than W_Q's; else nothing, and
    ``check_params`` names any misfit."""
    W_Q, W_K = params.get("blocks.0.attn.W_Q"), params.get("blocks.0.attn.W_K")
    d, H = fields["d_model"], fields["heads"]
    inferred, d_head = {}, fields.get("head_dim")
    if d_head is None:
        if W_Q is not None and W_Q.ndim == 2 and W_Q.shape[1] != d and W_Q.shape[1] % H == 0:
            d_head = inferred["head_dim"] = W_Q.shape[1] // H
        elif d % H:
            return {}
        else:
            d_head = d // H
    if W_K is None or W_K.ndim != 2 or W_K.shape[1] == H * d_head or W_K.shape[1] % d_head:
        return inferred
    kv_heads = W_K.shape[1] // d_head
    if kv_heads and H % kv_heads == 0:
        inferred["kv_heads"] = kv_heads
    return inferred


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
        except RecursionError:
            raise TfmError(f"--load {path}: key 'config' is not a JSON object tfm reads (nested "
                           f"too deeply)") from None
        has_config = True
    else:
        fields = _infer_fields(path, arrays)
        has_config = False
    params = {
        key[len("param/") :]: value for key, value in arrays.items() if key.startswith("param/")
    }
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
    return LoadedRun(fields, params, inputs, has_config, _task(path, arrays),
                     _interventions(path, arrays))


def _interventions(path, arrays) -> tuple:
    """The ``interventions`` key of a run saved with them: a JSON list of their descriptions.
    They changed that run's activations, never its weights, which load as they were."""
    if "interventions" not in arrays:
        return ()
    import json

    try:
        described = json.loads(str(arrays["interventions"][()]))
        ok = isinstance(described, list) and all(isinstance(d, str) for d in described)
    except (ValueError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise TfmError(f"--load {path}: key 'interventions' is not a list of what a run changed "
                       f"(like [\"ablate blocks.0.attn.head1\"])")
    return tuple(described)


def _task(path, arrays) -> dict | None:
    """The ``task`` key of a model tfm train saved: what it was trained on."""
    if "task" not in arrays:
        return None
    import json

    from tfmcli.train.tasks import TASKS

    try:
        task = json.loads(str(arrays["task"][()]))
        ok = (task["task"] in TASKS and all(isinstance(task[k], int) and task[k] >= 1
                                            for k in ("n", "symbols")))
    except (ValueError, TypeError, KeyError, RecursionError):
        ok = False
    if not ok:
        raise TfmError(f"--load {path}: key 'task' is not a task tfm train saved "
                       f"(like {{\"task\": \"reverse\", \"n\": 8, \"symbols\": 10}})")
    return task


def _check_keys(path, arrays):
    for key in arrays:
        if key in ("config", "loss", "task", "interventions") or key in INPUT_KEYS:
            continue
        if not any(key.startswith(s) and len(key) > len(s) for s in SECTIONS):
            raise TfmError(
                f"--load {path}: unknown key {key!r} (allowed: param/, grad/, act/, "
                f"actgrad/, input/tokens, input/targets, input/lengths, loss, config, task, "
                f"interventions)"
            )


def check_params(path, params: dict, cfg: Config) -> dict:
    """Every parameter ``cfg`` needs, of its shape and dtype, finite, and no other; each failure
    names the key."""
    misfit = param_misfit(params, cfg)
    if misfit is not None:
        kind, name, have, want, _ = misfit
        key = f"param/{name}"
        raise TfmError(f"--load {path}: " + {
            "missing": f"missing key {key!r}",
            "unknown": f"unknown key {key!r} (not a parameter of this model)",
            "shape": f"{key} has shape {have}, expected {want}",
            "dtype": f"{key} has dtype {have}, expected {want}"}[kind])
    for name, value in params.items():
        if not np.all(np.isfinite(value)):
            raise TfmError(f"--load {path}: param/{name} contains NaN or Inf")
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
    outside = first_outside(inputs, V)
    if outside is not None:
        name, _, low, high = outside
        extra = f" (or {IGNORE}: no target)" if name == "targets" else ""
        raise TfmError(f"--load {path}: input/{name} has values outside {low}..{high}{extra}")
    if not np.array_equal(inputs.lengths, cfg.lengths_array()):
        raise TfmError(f"--load {path}: input/lengths {inputs.lengths.tolist()} "
                       f"disagrees with the config's lengths {cfg.lengths_array().tolist()}")
    inputs = Inputs(*(value.astype(np.int64) for value in inputs))
    valid = (np.arange(T)[None, :] < inputs.lengths[:, None]) & (inputs.targets != IGNORE)
    if not valid.any():
        raise TfmError(f"--load {path}: input/targets has no target inside the lengths "
                       f"(every one is {IGNORE})")
    return inputs
