"""Runs out: the ``.npz`` layout, atomic saving, and JSON-ready values (``sources`` reads them
back).

The ``.npz`` layout (NumPy's own format, readable with ``allow_pickle=False``)::

    param/<name>     every parameter            grad/<name>     its gradient
    act/<name>       every named activation     actgrad/<name>  d loss / d activation
    input/tokens (B, T)   input/targets (B, T), -100 where a position has no target
    input/lengths (B,)
    loss             0-d float                  config          0-d str: JSON of the Config
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.errors import TfmError

if TYPE_CHECKING:   # (imported for the annotations only: saving needs no model code)
    from tfmcli.engine.inputs import Inputs
    from tfmcli.engine.model import Forward, Gradients

def run_arrays(cfg: Config, params: dict, inputs: Inputs, fwd: Forward | None = None,
               grads: Gradients | None = None) -> dict[str, np.ndarray]:
    """Everything of a run as flat ``npz`` keys. Parameters read when used (a streamed run's
    ``LazyParams``) stay unread until each is written (``RunArrays``)."""
    if hasattr(params, "meta"):
        return RunArrays(params, run_arrays(cfg, {}, inputs, fwd, grads))
    arrays = {f"param/{name}": value for name, value in params.items()}
    arrays.update({"input/tokens": inputs.tokens, "input/targets": inputs.targets,
                   "input/lengths": inputs.lengths, "config": np.array(cfg.to_json())})
    if fwd is not None:
        arrays.update({f"act/{name}": value for name, value in fwd.acts.items()})
        arrays["loss"] = np.array(fwd.loss, dtype=cfg.np_dtype)
        plan = fwd.caches.get("plan")
        if plan:   # what was changed, described, as JSON (docs/interventions.md)
            import json

            arrays["interventions"] = np.array(json.dumps(plan.described))
    if grads is not None:
        arrays.update({f"grad/{name}": value for name, value in grads.items()})
        arrays.update({f"actgrad/{name}": value for name, value in grads.acts.items()})
    return arrays


class NpzStream:
    """An ``.npz`` written an entry at a time, as a streamed run makes its arrays and drops
    them (``--save`` of a run a block at a time: a 7B model's gradients are written without
    being held). The entries go to a file beside ``path`` (``atomic_write``), renamed over it
    by ``close``; ``abandon`` (a run that failed) leaves nothing. NumPy reads it as it reads
    ``np.savez``'s: the same zip of ``.npy`` files, uncompressed."""

    def __init__(self, path):
        import zipfile
        from contextlib import ExitStack

        self.path, self.written, self.open = path, set(), True
        self._stack = ExitStack()
        try:
            self._zip = zipfile.ZipFile(self._stack.enter_context(atomic_write(path)), "w",
                                        zipfile.ZIP_STORED, allowZip64=True)
        except OSError as e:
            self._stack.close()
            raise TfmError(f"cannot write {path}: {e.strerror or e}") from None

    def add(self, key: str, array) -> None:
        """Write ``array`` as entry ``key`` now (a key written before is not written again)."""
        if key in self.written:
            return
        self.written.add(key)
        try:
            with self._zip.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)
        except OSError as e:
            self.abandon()
            raise TfmError(f"cannot write {self.path}: {e.strerror or e}") from None

    def close(self, arrays=None) -> None:
        """Write what of ``arrays`` (a mapping: each value read as it is written, so a
        checkpoint's lazily read weights are held one at a time) is not written yet, then
        finish the file and put it in place. A summary (what a streamed run kept of an array
        it wrote and dropped) is not an array: it is skipped."""
        for key in arrays or ():
            if key not in self.written:
                value = arrays[key]
                if hasattr(value, "finite"):   # a Summary: its array was written as dropped
                    continue
                self.add(key, value)
        try:
            self._zip.close()
            self.open = False
            self._stack.close()
        except OSError as e:
            raise TfmError(f"cannot write {self.path}: {e.strerror or e}") from None

    def abandon(self) -> None:
        """Stop: no file is left (an existing one at ``path`` stays as it was). Once closed,
        nothing."""
        if not self.open:
            return
        self.open = False
        try:
            self._zip.close()
        except OSError:
            pass
        failed = RuntimeError("abandoned")
        self._stack.__exit__(type(failed), failed, None)
        self._stack.pop_all()


class RunArrays(Mapping):
    """``run_arrays``' keys, each value got only when it is read: a checkpoint's weights read
    one at a time as ``NpzStream.close`` writes them."""

    def __init__(self, params: dict, rest: dict):
        self.params, self.rest = params, rest

    def __getitem__(self, key: str):
        if key.startswith("param/") and key[6:] in self.params:
            return self.params[key[6:]]
        return self.rest[key]

    def __iter__(self):
        yield from (f"param/{name}" for name in self.params)
        yield from self.rest

    def __len__(self) -> int:
        return len(self.params) + len(self.rest)


def output_target(path: str | os.PathLike) -> tuple[Path, bool]:
    """Where a write to ``path`` lands, and whether it lands in a file of its own.

    A symlink to a file is followed, so that the file it names is replaced and the link kept. A
    device or a pipe (``/dev/null``, ``/dev/stdout``, a shell's ``>(...)``) is not a file: it is
    written in place, never renamed over (which would put a plain file where the device was).
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode   # (through any symlinks)
    except OSError:                  # nothing there yet (or unreadable: the write says why)
        mode = stat.S_IFREG
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return path, False
    return Path(os.path.realpath(path)), True


@contextmanager
def atomic_write(path: str | os.PathLike):
    """Yield a binary file in ``path``'s folder; rename it over ``path`` only if the block succeeds.

    An interrupted or failed write leaves no file behind, and an existing ``path`` untouched. A
    device or a pipe is written in place (``output_target``).
    """
    import tempfile  # here: only a run that saves pays for importing it

    named = path
    path, is_file = output_target(path)
    if not is_file:   # a zip archive seeks as it is written: write it aside, then copy it
        import shutil

        with tempfile.TemporaryFile() as f:
            yield f
            f.seek(0)
            with open(path, "wb") as stream:
                shutil.copyfileobj(f, stream)
        return
    folder = path.parent
    if not folder.is_dir():
        raise TfmError(f"cannot write {named}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes 0600; a file follows the umask
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_npz(path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed ``.npz``, atomically."""
    save_outputs(path, arrays)


def save_outputs(npz=None, arrays=None, text_path=None, text: str | None = None) -> None:
    """``arrays`` to ``npz`` and ``text`` to ``text_path`` (either may be None), each written
    aside and renamed over its target only when both were written: an output that cannot be
    written leaves the other as it was (``--save X --svg Y``)."""
    from contextlib import ExitStack, contextmanager

    failing = {"path": None}   # the output whose write, rename or copy is under way

    @contextmanager
    def written(path):
        failing["path"] = path
        with atomic_write(path) as f:
            yield f
            failing["path"] = path   # its rename (a device's copy) comes next

    outputs = [(path, write) for path, write in (
        (npz, lambda f: np.savez(f, **arrays)),
        (text_path, lambda f: f.write(text.encode("utf-8")))) if path is not None]
    # a device or a pipe takes its bytes when its block ends, and may fail then: entered last,
    # it ends first, before any file is renamed over its target
    outputs.sort(key=lambda output: not output_target(output[0])[1])
    try:
        with ExitStack() as stack:
            for path, write in outputs:
                write(stack.enter_context(written(path)))
    except OSError as e:
        raise TfmError(f"cannot write {failing['path']}: {e.strerror or e}") from None


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
