"""The machine's cores, used by tfm itself, with NumPy's BLAS held to one thread meanwhile.

NumPy's element-wise work runs on one core. OpenBLAS (the BLAS in NumPy's wheels) runs a large
matrix product on every core, then keeps its helper threads spinning for about 0.1 s in case
another product follows, so a second thread of element-wise work finds no free core. So the
heavy operations of the fast path (``ops``: linear layers, attention, layer norm) cut their
work into parts along an axis whose parts are independent (rows, heads, columns: never the axis
of a sum; ``run``), or make independent products at once (a linear layer's dx and dW;
``together``), one per core, in threads of tfm's own, each product on one BLAS thread. BLAS's
helpers are not woken, and attention's softmax and layer norm get every core too.

Every number of a part is computed as it is in one piece, in the same order, with one
exception: BLAS blocks a product by its shape, so a product cut in two can round differently
in the last bit, as it already does when BLAS itself runs on another number of threads.

The parts are one (the caller's thread, plain NumPy) when the work is small or a product thin,
when BLAS is held to one thread already (by the user, with threadpoolctl or
``OPENBLAS_NUM_THREADS=1``), inside ``one_piece()`` (the reference path), and when NumPy's BLAS
is not an OpenBLAS whose threads tfm can hold.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import numpy as np

SMALL = 1 << 25   # multiply-adds a part needs for sharing to pay: a hand-off costs 0.1-0.5 ms
                  # (threads woken and the GIL passed), and 2^25 take about 0.8 ms on one core
PASS = 16         # an element-wise pass over one entry takes about as long as 16 multiply-adds
THIN = 256        # a matrix product with a side shorter than this is not cut (see matmul)
BLAS_TILE = 64    # a product's rows or columns are cut on multiples of this: no part ends in
                  # a narrow edge tile that BLAS runs slower


@functools.lru_cache(maxsize=1)
def blas_threads():
    """(get, set) for the thread count of NumPy's own OpenBLAS, or None when there is none.

    NumPy's wheels bundle it in ``numpy.libs`` (Linux, Windows) or ``numpy/.dylibs`` (macOS);
    only a library NumPy has already loaded is taken (RTLD_NOLOAD), never a second copy.
    """
    import ctypes  # here, not at import: what tfm loads at start-up counts (issue 11)
    import glob

    root = os.path.dirname(np.__file__)
    paths = glob.glob(os.path.join(root, os.pardir, "numpy.libs", "*openblas*"))
    paths += glob.glob(os.path.join(root, ".dylibs", "*openblas*"))
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=mode)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", "")):
            get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                return get, set_
    return None


@functools.lru_cache(maxsize=1)
def _pool(pid: int):
    """The threads the parts run in, made on first use. One per process: a child made by fork
    has none of its parent's threads, so it makes its own (``pid``)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="tfm")


_one_piece = contextvars.ContextVar("tfm_one_piece", default=False)


@contextlib.contextmanager
def one_piece():
    """Every ``run`` inside calls its part once on the whole, with BLAS as it is: plain NumPy,
    for the reference path (``forward(..., fast=False)``)."""
    token = _one_piece.set(True)
    try:
        yield
    finally:
        _one_piece.reset(token)


def _part_with(errors, part, where):
    with np.errstate(**errors):   # the caller's: an overflow is raised in a part as in one piece
        part(where)


def run(part, n: int, work: int, multiple: int = 1) -> None:
    """Call ``part(slice)`` on slices of ``range(n)`` that together cover it once.

    ``work``: about how many multiply-adds the whole is (an element-wise pass over an entry
    counts ``PASS``); a part must have ``SMALL`` of them for sharing to pay. ``multiple``: every
    cut between parts falls on a multiple of it (a matrix product's rows or columns: see
    ``BLAS_TILE``). Shared, the slices run at once, one per BLAS thread the caller had, each in
    its own thread (the first in the caller's), under the caller's ``np.errstate``, with BLAS
    held to one thread until all are done. An error in a part is raised here.
    """
    most = min(n // multiple, work // SMALL)   # parts each of at least SMALL, cut on multiples
    threads = _threads(most > 1)
    count = min(threads, most)
    if count <= 1:
        part(slice(0, n))
        return
    cuts = [i * (n // multiple) // count * multiple for i in range(count)] + [n]
    _run_parts(part, [slice(a, b) for a, b in zip(cuts, cuts[1:])], threads)


def together(tasks, work: int) -> None:
    """Call every one of ``tasks`` (each about ``work`` multiply-adds) once: at once, one per
    core, with BLAS held to one thread, when there are exactly as many BLAS threads as tasks;
    else one after another, each free to cut its own work into parts (``run``). Two whole
    products on two cores beat each product cut in two: a cut product packs its shared operand
    once per part."""
    threads = _threads(work >= SMALL)
    if threads != len(tasks):
        for task in tasks:
            task()
        return
    _run_parts(lambda i: tasks[i](), list(range(threads)), threads)


def _threads(worth_sharing: bool) -> int:
    """The BLAS threads work may be shared over: 1 when it is not worth sharing, inside
    ``one_piece``, or without an OpenBLAS whose threads tfm can hold."""
    control = blas_threads() if worth_sharing and not _one_piece.get() else None
    return control[0]() if control is not None else 1


def _run_parts(part, pieces, threads: int):
    """``part(piece)`` for every piece at once: the first here, the others in the pool, with
    BLAS held to one thread until all are done, then given back its ``threads``. The parts'
    errors are raised here."""
    from concurrent.futures import wait

    set_threads = blas_threads()[1]
    errors = np.geterr()
    set_threads(1)
    try:
        futures = [_pool(os.getpid()).submit(_part_with, errors, part, p) for p in pieces[1:]]
        try:
            part(pieces[0])
        finally:
            wait(futures)
    finally:
        set_threads(threads)
    for future in futures:
        future.result()


def thin(*shapes) -> bool:
    """Whether a matrix product of these operand shapes has a side under ``THIN``."""
    return min(min(shape) for shape in shapes) < THIN


def matmul(a, b, out, add=None) -> None:
    """``out = a @ b`` (+ ``add``, a row vector or a number, if given) for 2-D arrays, in parts
    of a's rows or of b's columns, whichever are more: each part packs the operand it shares
    whole, so that one should be the smaller (``run``). A thin product (a side under ``THIN``)
    stays whole, on BLAS's own threads, which ran those faster than parts did (GPT-2's shapes
    on 32 tokens: 32 rows, or a weight gradient summed over 32 rows)."""
    m, k = a.shape
    n = b.shape[1]
    add = None if add is None else np.broadcast_to(add, (n,))

    def rows(r):
        np.matmul(a[r], b, out=out[r])
        if add is not None:
            out[r] += add

    def columns(c):
        np.matmul(a, b[:, c], out=out[:, c])
        if add is not None:
            out[:, c] += add[c]

    if thin(a.shape, b.shape):
        rows(slice(0, m))
    elif m >= n:
        run(rows, m, m * k * n, BLAS_TILE)
    else:
        run(columns, n, m * k * n, BLAS_TILE)
