"""The safetensors file format, read and written with NumPy alone.

A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's dtype,
shape and byte range (``data_offsets``, from the end of the header), then the raw little-endian
bytes. The ``safetensors`` package's NumPy API has no bfloat16, the type LLaMA checkpoints are
stored in, so LLaMA folders are read here: bfloat16 is float32's upper 16 bits, so shifting
them back is exact.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources.folder import known, shown

DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype("<u2")}   # bfloat16: read as its bits, widened to float32
MAX_HEADER = 100_000_000   # the format's own limit on the JSON header


def read_header(path) -> tuple[dict, int]:
    """(name -> {"dtype", "shape", "data_offsets"}, the byte where the data starts); a TfmError
    naming the file (and the tensor) when it is not a safetensors file tfm reads: every entry's
    dtype one of ``DTYPES``, its shape whole numbers, its offsets two whole numbers that hold
    exactly its bytes, inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise TfmError(f"--load {path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", start)
        if n > min(MAX_HEADER, size - 8):
            raise TfmError(f"--load {path}: not a safetensors file (a header of {n:,} bytes "
                           f"in a file of {size:,})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise TfmError(f"--load {path}: not a safetensors file (its header is not JSON: "
                           f"{e})") from None
        except RecursionError:
            raise TfmError(f"--load {path}: not a safetensors file (its header is JSON nested "
                           f"too deeply)") from None
    if not isinstance(header, dict):
        raise TfmError(f"--load {path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data = 8 + n
    for name, entry in header.items():
        _check_entry(path, name, entry, size - data)
    return header, data


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(path, name, entry, data_size):
    """One header entry: a dtype tfm reads, a shape of whole numbers >= 0, and data_offsets
    [begin, end], whole numbers, whose bytes are its shape's and lie in the file."""
    if not isinstance(entry, dict):
        raise TfmError(f"--load {path}: key {name!r} is {shown(entry)}, not an object of dtype, "
                       f"shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not known(dtype, DTYPES):
        raise TfmError(f"--load {path}: key {name!r} has dtype {shown(dtype)} (tfm reads "
                       f"{', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_whole(n) and n >= 0 for n in shape):
        raise TfmError(f"--load {path}: key {name!r} has shape {shown(shape)}, not a list of "
                       f"whole numbers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_whole, offsets)):
        raise TfmError(f"--load {path}: key {name!r} has data_offsets {shown(offsets)}, not two "
                       f"whole numbers [begin, end]")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if not (0 <= begin <= end <= data_size and end - begin == want):
        raise TfmError(f"--load {path}: key {name!r} has bytes {shown(begin)}..{shown(end)}, but "
                       f"its shape {shown(tuple(shape))} needs {want:,} and the file holds "
                       f"{data_size:,} after its header (truncated?)")


ROWS = 64   # stored rows widened and transposed at a time: a block stays in cache


def read_tensor(path, header: dict, data: int, name: str, dtype=None,
                transpose: bool = False) -> np.ndarray:
    """One tensor of a file whose header ``read_header`` gave: float64, float32 or float16 as
    stored, bfloat16 widened to float32 (exactly); or in ``dtype``, and a matrix ``transpose``d,
    made in one pass a block of rows at a time (a 2048 x 8192 bfloat16 matrix to float32,
    transposed: 78 ms, against 167 for widening, then transposing the whole)."""
    entry = header[name]
    begin, end = entry["data_offsets"]
    stored = np.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])   # read straight into it
    with open(path, "rb") as f:
        f.seek(data + begin)
        got = f.readinto(memoryview(stored.reshape(-1)).cast("B"))
    if got != end - begin:
        raise TfmError(f"--load {path}: key {name!r} is cut short (truncated file)")
    if dtype is None and not transpose and entry["dtype"] != "BF16":
        return stored
    dtype = np.dtype(np.float32 if entry["dtype"] == "BF16" else stored.dtype) \
        if dtype is None else np.dtype(dtype)
    if stored.ndim < 2:
        return _widened(stored).astype(dtype, copy=False)
    out = np.empty(stored.shape[::-1] if transpose else stored.shape, dtype=dtype)
    for r in range(0, stored.shape[0], ROWS):
        block = _widened(stored[r:r + ROWS])
        if transpose:
            out[..., r:r + ROWS] = block.T
        else:
            out[r:r + ROWS] = block
    return out


def _widened(stored: np.ndarray) -> np.ndarray:
    """bfloat16's bits to float32, exactly: its 16 bits are the top half of a float32's (the
    second uint16 of each uint32 on a little-endian machine); other dtypes as they are."""
    if stored.dtype != DTYPES["BF16"]:
        return stored
    top = 1 if sys.byteorder == "little" else 0
    out = np.empty(stored.shape, dtype=np.uint32)
    halves = out.view(np.uint16).reshape(*stored.shape, 2)
    halves[..., 1 - top] = 0
    halves[..., top] = stored
    return out.view(np.float32)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16's bits (uint16), rounded to nearest, ties to even, as torch rounds."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return np.where(np.isnan(x), 0x7FC0, (bits + rounding) >> 16).astype(np.uint16)


def write(path, tensors: dict[str, np.ndarray], bfloat16: bool = False, metadata=None) -> None:
    """Write ``tensors`` as a safetensors file: float64, float32 and float16 as they are, or
    with ``bfloat16`` every float tensor rounded to bfloat16 (as LLaMA checkpoints are)."""
    header, chunks, offset = {}, [], 0
    for name, value in tensors.items():
        value = np.ascontiguousarray(value)
        if bfloat16:
            kind, raw = "BF16", to_bfloat16_bits(value).astype("<u2").tobytes()
        else:
            kind = {np.dtype("float64"): "F64", np.dtype("float32"): "F32",
                    np.dtype("float16"): "F16"}[value.dtype]
            raw = value.astype(DTYPES[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned, as the format advises
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in chunks:
            f.write(raw)
