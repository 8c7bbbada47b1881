"""A GGUF file as llama.cpp writes it: its header read here, its tensors mapped and dequantized
by the ``gguf`` package (llama.cpp's own Python library).

The layout (GGUF 2 and 3, little-endian): ``GGUF``, the version (uint32), the tensor and
key-value counts (uint64 each); each key-value pair (a string key, a value type, the value);
each tensor's name, its dimensions (``ne``, fastest first), its type and its offset from the
data, which starts at the next multiple of ``general.alignment`` (32 by default). A string is a
uint64 length and its UTF-8 bytes; an array an element type, a uint64 count and the elements.

Why not ``gguf.GGUFReader``: it makes a NumPy array of every field's every part, so opening
a file whose vocabulary holds LLaMA 3's 128,256 tokens took it 11.6 s here; this reader takes
the same header in about 0.2 s (each string array read in one loop), and ``tests/test_gguf.py``
holds it to ``GGUFReader``'s fields and tensors on every file the tests write. The value types,
the quantization types, their block sizes and the dequantization are ``gguf``'s own.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from tfmcli.errors import TfmError
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf import MAGIC

VERSIONS = (2, 3)
ALIGNMENT = 32   # general.alignment's default (gguf.GGUF_DEFAULT_ALIGNMENT)
SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
NUMPY = {kind: np.dtype(code) for kind, code in SCALARS.items()}
INTEGERS = (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
            GGMLQuantizationType.I64)   # index tensors, never a weight


class Tensor(NamedTuple):
    """One tensor's entry: its ``shape`` in NumPy's order (the reverse of GGUF's ``ne``: the
    layout of the PyTorch tensor the converter wrote), its ``kind`` and its bytes' ``start``
    and length in the file."""
    shape: tuple[int, ...]
    kind: GGMLQuantizationType
    start: int
    nbytes: int


class Truncated(Exception):
    """The header runs past the end of the file."""


class GgufFile:
    """A GGUF file's metadata (``meta``: key -> value: a number, a bool, a string, a list of
    strings or a NumPy array of numbers), its tensors' entries (``tensors``: name -> Tensor, in
    the file's order) and, read when asked for, each tensor dequantized (``array``)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.size = f.seek(0, 2)
                if self.size < 24:
                    raise TfmError(f"--load {self.path}: not a GGUF file ({self.size} bytes, "
                                   f"shorter than a GGUF header)")
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise TfmError(f"--load {self.path}: cannot read it ({e.strerror or e})") from None
        magic = self.map[:4]
        if magic != MAGIC:
            raise TfmError(f"--load {self.path}: not a GGUF file (it starts {magic!r}, not "
                           f"b'GGUF')")
        try:
            self._read_header()
        except Truncated:
            raise TfmError(f"--load {self.path}: its header runs past the end of the file "
                           f"({self.size:,} bytes: truncated?)") from None

    # ------------------------------------------------------------------ the header

    def _read_header(self) -> None:
        (version,) = struct.unpack_from("<I", self.map, 4)
        if version not in VERSIONS:
            order = " (a big-endian file: tfm reads little-endian ones)" \
                if version & 0xFFFF == 0 else ""
            raise TfmError(f"--load {self.path}: GGUF version {version}{order}; tfm reads "
                           f"versions 2 and 3")
        self.version = version
        n_tensors, n_keys = struct.unpack_from("<QQ", self.map, 8)
        self.at = 24
        self.meta = {}
        for _ in range(self._count(n_keys, 12)):
            key = self._string("a key")
            (kind,) = self._unpack("<I")
            self.meta[key] = self._value(key, kind)
        alignment = self.meta.get("general.alignment", ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
                or alignment & (alignment - 1):
            raise TfmError(f"--load {self.path}: key 'general.alignment' is {shown(alignment)}, "
                           f"not a power of two")
        entries = []
        for _ in range(self._count(n_tensors, 24)):
            name = self._string("a tensor's name")
            (n_dims,) = self._unpack("<I")
            if not 1 <= n_dims <= 4:
                raise TfmError(f"--load {self.path}: tensor {shown(name)} has {n_dims} "
                               f"dimensions (GGUF's tensors have 1 to 4)")
            ne = struct.unpack_from(f"<{n_dims}Q", self.map, self._advance(8 * n_dims))
            kind, offset = self._unpack("<IQ")
            entries.append((name, ne, kind, offset))
        data = -(-self.at // alignment) * alignment
        self.tensors = {}
        for name, ne, kind, offset in entries:
            self.tensors[name] = self._tensor(name, ne, kind, data + offset)

    def _advance(self, n: int) -> int:
        """Where the next ``n`` bytes start; Truncated when they pass the end."""
        start = self.at
        if start + n > self.size:
            raise Truncated
        self.at += n
        return start

    def _unpack(self, code: str) -> tuple:
        return struct.unpack_from(code, self.map, self._advance(struct.calcsize(code)))

    def _count(self, n: int, least: int) -> int:
        """A count of items each at least ``least`` bytes long: Truncated when the rest of the
        file cannot hold them (a count of 2**63 is not looped over)."""
        if n * least > self.size - self.at:
            raise Truncated
        return n

    def _string(self, what: str) -> str:
        (n,) = self._unpack("<Q")
        start = self._advance(self._count(n, 1))
        try:
            return self.map[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise TfmError(f"--load {self.path}: {what} at byte {start:,} is not UTF-8") \
                from None

    def _value(self, key: str, kind: int):
        if kind in SCALARS:
            (value,) = self._unpack(SCALARS[kind])
            return value
        if kind == GGUFValueType.STRING:
            return self._string(f"key {key!r}")
        if kind == GGUFValueType.ARRAY:
            item, n = self._unpack("<IQ")
            if item in NUMPY:
                size = NUMPY[item].itemsize
                start = self._advance(self._count(n, size) * size)
                return np.frombuffer(self.map, NUMPY[item], n, start).copy()
            if item == GGUFValueType.STRING:
                return self._strings(key, self._count(n, 8))
            if item == GGUFValueType.ARRAY:
                return [self._value(key, item) for _ in range(self._count(n, 12))]
        raise TfmError(f"--load {self.path}: key {key!r} has value type {kind}, which GGUF "
                       f"does not define")

    def _strings(self, key: str, n: int) -> list[str]:
        """An array of ``n`` strings (a vocabulary: 128,256 of them in LLaMA 3), in one loop."""
        data, at, size, out = self.map, self.at, self.size, [None] * n
        unpack = struct.Struct("<Q").unpack_from
        for i in range(n):
            if at + 8 > size:
                raise Truncated
            (length,) = unpack(data, at)
            at += 8
            if at + length > size:
                raise Truncated
            out[i] = data[at:at + length]
            at += length
        self.at = at
        try:
            return [raw.decode("utf-8") for raw in out]
        except UnicodeDecodeError:
            bad = next(i for i, raw in enumerate(out) if not _utf8(raw))
            raise TfmError(f"--load {self.path}: key {key!r}: entry {bad} is not UTF-8 "
                           f"({shown(out[bad])})") from None

    def _tensor(self, name: str, ne: tuple, kind: int, start: int) -> Tensor:
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise TfmError(f"--load {self.path}: tensor {name!r} has type {kind}, which the "
                           f"gguf package (llama.cpp's) does not know; a newer gguf may") \
                from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if ne[0] % block:
            raise TfmError(f"--load {self.path}: tensor {name!r} is {kind.name} with rows of "
                           f"{ne[0]}, not a multiple of its blocks of {block}")
        nbytes = int(np.prod(ne, dtype=object)) // block * block_bytes
        if start + nbytes > self.size:
            raise TfmError(f"--load {self.path}: tensor {name!r} needs bytes {start:,}.."
                           f"{start + nbytes:,}, and the file has {self.size:,} (truncated?)")
        return Tensor(tuple(int(n) for n in ne[::-1]), kind, start, nbytes)

    # ------------------------------------------------------------------ the tensors

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized, in NumPy's order: float32 (exactly its values: every
        quantization type's values are float32's, F16's and BF16's included), float64 for F64.
        TfmError for a type ``gguf.quants`` cannot dequantize."""
        tensor = self.tensors[name]
        raw = np.frombuffer(self.map, np.uint8, tensor.nbytes, tensor.start)
        if tensor.kind == GGMLQuantizationType.F64:
            return raw.view("<f8").reshape(tensor.shape)
        if tensor.kind in INTEGERS:
            raise TfmError(f"--load {self.path}: tensor {name!r} holds integers "
                           f"({tensor.kind.name}), not weights")
        rows = raw.reshape(-1, raw.size // max(1, int(np.prod(tensor.shape[:-1]))))
        width = tensor.shape[-1] if tensor.shape else 1
        out = np.empty((len(rows), width), np.float32)
        step = max(1, CHUNK // max(1, width))   # a few rows at a time: the dequantizer's
        try:                                     # scratch is several times what it makes
            for start in range(0, len(rows), step):
                out[start:start + step] = quants.dequantize(rows[start:start + step],
                                                            tensor.kind)
        except NotImplementedError:
            raise TfmError(f"--load {self.path}: tensor {name!r} is {tensor.kind.name}, which "
                           f"the gguf package cannot dequantize yet") from None
        self.let_go(tensor.start, tensor.nbytes)
        return out.reshape(tensor.shape)

    def let_go(self, start: int, size: int) -> None:
        """Unmap the pages of bytes read and copied out: the file's pages stay in the page
        cache, but no longer count as this process's memory (a 7B Q4_K_M file read whole,
        as a streamed backward reads it, would add its 4 GiB to the peak)."""
        page = mmap.PAGESIZE
        first = start - start % page
        if hasattr(self.map, "madvise") and size:
            self.map.madvise(mmap.MADV_DONTNEED, first, start + size - first)

    def kinds(self) -> Counter:
        """How many tensors of each type: Counter({"Q8_0": 14, "F32": 7})."""
        return Counter(tensor.kind.name for tensor in self.tensors.values())


CHUNK = 1 << 22   # values dequantized at a time (16 MB of float32, and its scratch)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
