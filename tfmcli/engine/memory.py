"""Let large arrays reuse freed memory instead of fresh pages from the kernel.

glibc's malloc hands every block above its mmap threshold (128 KiB, rising to at most 32 MiB as
such blocks are freed) to the kernel when it is freed, and gets a new mapping for the next one.
The forward and backward make dozens of large arrays, and every 4 KiB page of each new mapping
faults on first touch: about 27 thousand faults and 100-190 ms of system time per forward +
backward of the block in ``benchmarks/bench.py``, a quarter of its time. With the thresholds
raised, freed blocks stay in malloc's heap and the next step's arrays land in them: no faults
after the first step.

The price is that the process keeps its peak memory until it exits, which suits a command that
runs one job and ends. The commands that run the model call ``keep_freed_memory`` first; a
notebook may call it too (``tfmcli.engine.memory.keep_freed_memory()``). Without glibc it does
nothing.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1   # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
LARGEST = 1 << 30       # blocks up to 1 GiB come from the heap; larger ones are still mapped


def keep_freed_memory() -> bool:
    """Keep freed blocks (up to 1 GiB) in the process's heap for reuse. True if it took."""
    try:
        mallopt = ctypes.CDLL(None).mallopt   # the C library the interpreter runs on
    except (OSError, AttributeError, TypeError):   # not glibc (macOS, musl, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST) and mallopt(M_TRIM_THRESHOLD, 2 * LARGEST))
