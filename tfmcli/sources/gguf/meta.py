"""A GGUF file's metadata as a reader of one architecture asks for it: ``{arch}.`` keys read
by their short names (``embedding_length``), each checked for its kind, every error naming the
file and the key."""

from __future__ import annotations

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources.folder import LARGEST, shown
from tfmcli.sources.gguf.file import GgufFile

MISSING = object()


class Meta:
    """The metadata of ``file`` under ``general.architecture`` ``arch``."""

    def __init__(self, file: GgufFile, arch: str):
        self.file, self.arch, self.path = file, arch, file.path

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def get(self, name: str, default=None):
        return self.file.meta.get(self.key(name), default)

    def size(self, name: str, default=MISSING) -> int:
        """``{arch}.name``, a whole number in 1..2**31 - 1 (``default`` when it is absent)."""
        value = self.file.meta.get(self.key(name), MISSING)
        if value is MISSING:
            if default is MISSING:
                raise TfmError(f"--load {self.path}: missing key {self.key(name)!r}")
            return default
        if isinstance(value, (bool, np.ndarray, list, str, float)) or not 1 <= value <= LARGEST:
            raise TfmError(f"--load {self.path}: key {self.key(name)!r} is {shown(value)}, not "
                           f"a whole number in 1..{LARGEST}")
        return int(value)

    def number(self, name: str, default=MISSING) -> float:
        """``{arch}.name``, a finite positive number, as the decimal it was written as: the
        converter stores config.json's numbers as float32 (1e-05 becomes
        9.999999747378752e-06), and the shortest decimal that rounds to the same float32
        (1e-05) is the number config.json held, whenever it held one of 7 digits or fewer."""
        value = self.file.meta.get(self.key(name), MISSING)
        if value is MISSING:
            if default is MISSING:
                raise TfmError(f"--load {self.path}: missing key {self.key(name)!r}")
            return default
        if isinstance(value, (bool, np.ndarray, list, str)) or not np.isfinite(value) \
                or value <= 0:
            raise TfmError(f"--load {self.path}: key {self.key(name)!r} is {shown(value)}, not "
                           f"a positive finite number")
        return decimal(value)

    def switch(self, name: str, default: bool) -> bool:
        value = self.file.meta.get(self.key(name), default)
        if not isinstance(value, bool):
            raise TfmError(f"--load {self.path}: key {self.key(name)!r} is {shown(value)}, not "
                           f"true or false")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.file.tensors

    def shape(self, tensor: str) -> tuple[int, ...]:
        """A tensor's shape in NumPy's order (the PyTorch tensor the converter wrote)."""
        if tensor not in self.file.tensors:
            raise TfmError(f"--load {self.path}: no tensor {tensor!r} (a {self.arch} model has "
                           f"one)")
        return self.file.tensors[tensor].shape


def decimal(value: float) -> float:
    """A float32's value as the shortest decimal that rounds to it (``np.float32``'s repr);
    a value no float32 holds exactly (a float64 key) as it is."""
    single = np.float32(value)
    return float(str(single)) if float(single) == float(value) else float(value)
