"""The machine's cores, used by tfm itself, with NumPy's BLAS held to one thread meanwhile.

NumPy's element-wise work runs on one core. OpenBLAS (the BLAS in NumPy's wheels) runs a large
matrix product on every core, then keeps its helper threads spinning for about 0.1 s in case
another product follows, so a second thread of element-wise work finds no free core. So the
heavy operations of the fast path (``ops``: linear layers, attention, layer norm) cut their
work into parts along an axis whose parts are independent (rows, heads, columns: never the axis
of a sum; ``run``), one per core, in threads of tfm's own, each product on one BLAS thread.
BLAS's helpers are not woken, and attention's softmax and layer norm get every core too. Work
off the critical path (a linear layer's dW, which nothing reads before the backward ends) is
done ``later``, on another core, while the caller goes on: it fills the time the caller spends
on one core, and a part of a ``run`` goes before it. tfm's threads are kept off the caller's
core (``_Queue._steer``).

A part's element-wise work over long rows that are not one contiguous run (a block of the
scores, a bias broadcast over a product) runs ``unbuffered``: NumPy's buffer costs more than
it saves there.

Every number of a part is computed as it is in one piece, in the same order, with one
exception: BLAS blocks a product by its shape, so a product cut in two can round differently
in the last bit, as it already does when BLAS itself runs on another number of threads.

The parts are one (the caller's thread, plain NumPy) when the work is small or a product thin,
when BLAS is held to one thread already (by the user, with threadpoolctl or
``OPENBLAS_NUM_THREADS=1``), inside ``one_piece()`` (the reference path, and the fast path of a
step too small for parts to pay: ``model.threaded``), and when threadpoolctl finds no BLAS
whose threads it can hold (``blas_threads``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import os
import threading

import numpy as np

SMALL = 1 << 25   # multiply-adds (of float32: see cost) a part needs for sharing to pay: a hand-
                  # off costs 0.1-0.5 ms (threads woken and the GIL passed), and 2^25 take about
                  # 0.8 ms on one core
PASS = 16         # an element-wise pass over one entry takes about as long as 16 multiply-adds
THIN = 256        # a matrix product with a side shorter than this is not cut (see matmul)
BLAS_TILE = 64    # a product's rows or columns are cut on multiples of this: no part ends in
                  # a narrow edge tile that BLAS runs slower
UNBUFFERED = 16   # entries: the smallest buffer NumPy's ufuncs take (see unbuffered)
LONG_ROW = 4096   # bytes: rows shorter than this stay buffered (see unbuffered)
# NumPy 2.3 rebuilt its buffered iteration: since then a row's sum is made the same way whatever
# the buffer's size. Before, a small buffer cut the sum into short blocks and changed its rounding
# (NumPy 1.26 and 2.2, measured), so there tfm leaves the buffer as it is.
BUFFER_FREE_SUMS = np.lib.NumpyVersion(np.__version__) >= "2.3.0"


@functools.lru_cache(maxsize=1)
def blas_threads():
    """(get, set) for the thread count of NumPy's BLAS (OpenBLAS, MKL or BLIS, through
    threadpoolctl), or None when threadpoolctl finds none. With several BLAS libraries loaded
    (torch brings its own), NumPy's is the one in NumPy's own folders (its wheels bundle it in
    ``numpy.libs`` or ``numpy/.dylibs``), else the first."""
    from threadpoolctl import ThreadpoolController  # here, not at import: start-up counts

    libraries = ThreadpoolController().select(user_api="blas").lib_controllers
    home = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(np.__file__))), "numpy")
    numpys = [lib for lib in libraries if os.path.realpath(lib.filepath).startswith(home)]
    chosen = (numpys or libraries)[:1]
    return (chosen[0].get_num_threads, chosen[0].set_num_threads) if chosen else None


_one_piece = contextvars.ContextVar("tfm_one_piece", default=False)
_whole = contextvars.ContextVar("tfm_whole", default=False)      # in a task run later
_deferred = contextvars.ContextVar("tfm_deferred", default=None)  # the scope's tasks


@contextlib.contextmanager
def one_piece():
    """Every ``run`` inside calls its part once on the whole, with BLAS as it is: plain NumPy,
    for the reference path (``forward(..., fast=False)``)."""
    token = _one_piece.set(True)
    try:
        yield
    finally:
        _one_piece.reset(token)


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's BLAS held to one thread inside (when tfm can hold it; not in ``one_piece``), for
    a run of small products. OpenBLAS shares a product of half a million multiply-adds among
    its threads: on an idle machine that saves microseconds, but when another program has a
    core every product waits for it. ``tfm train``'s 600 steps (``train.small``), with one
    core busy elsewhere: 13.6 ms a step on BLAS's threads, 4.5 held (the command 5.7-6.8 s
    against 3.0-3.8); on an idle machine a step took 1.02 of its time held (paired, 6 rounds
    of 150 steps). The numbers are the same bits."""
    threads = _threads(True)
    if threads > 1:
        _hold(threads)
    try:
        yield
    finally:
        if threads > 1:
            _let_go()


def each(call, items, progress=None) -> list:
    """``[call(item) for item in items]``, the items shared among the machine's cores: each a
    task run whole, by tfm's threads and the caller alike, each taking the first item no one
    has begun, with BLAS held to one thread until all are done (a thin product gains little
    from BLAS's threads, and two of them each on a core of its own are two at once: the prompt
    pairs of ``tfm circuit``). The results in the items' order, whatever order they end in;
    ``progress(done, total)`` called by the caller with how many have ended; the first error
    raised, the items no one has begun by then left undone. One at a time, in the caller, with
    BLAS as it is, where ``run`` would not share (one core, BLAS already held, inside a
    task)."""
    items = list(items)
    threads = _threads(len(items) > 1)
    if threads < 2 or len(items) < 2:
        made = []
        for item in items:
            made.append(call(item))
            if progress is not None:
                progress(len(made), len(items))
        return made
    made = [None] * len(items)

    def part(k: int) -> None:
        made[k] = call(items[k])

    tasks = [_Task(functools.partial(part, k), whole=True) for k in range(len(items))]
    told = 0

    def tell() -> None:
        nonlocal told
        ended = sum(task.done.is_set() for task in tasks)
        if progress is not None and ended > told:
            told = ended
            progress(ended, len(tasks))

    _hold(threads)
    try:
        queue = _queue(os.getpid())
        for task in tasks:
            queue.put(task, threads - 1, urgent=False)
        for task in tasks:   # the caller takes what no thread has begun, in order
            if any(t.error is not None for t in tasks):
                break
            if task.take():
                task.run()
                tell()
        _finish(tasks, run_left=False)   # the rest waited for (or, after an error, dropped)
        if not any(t.error is not None for t in tasks):
            tell()
    finally:
        _let_go()
    _raise_first(tasks)
    return made


def cost(multiply_adds: int, dtype) -> int:
    """Work as ``run`` and ``later`` count it: in multiply-adds of float32, so that ``SMALL`` is
    one length of time in any dtype. A wider number takes as much longer: float64's products
    run at half float32's rate on one core (52 against 102 GFLOP/s here) and its element-wise
    passes move twice the bytes. Counted so, layer norm's float64 passes at the bench's size
    are cut in two, and the step took 0.983 of its time (paired, 2 x 60 rounds)."""
    return multiply_adds * np.dtype(dtype).itemsize // 4


def run(part, n: int, work: int, multiple: int = 1, busy: int = 0) -> None:
    """Call ``part(slice)`` on slices of ``range(n)`` that together cover it once.

    ``work``: about how many multiply-adds the whole is (an element-wise pass over an entry
    counts ``PASS``), in float32's (``cost``); a part must have ``SMALL`` of them for sharing to
    pay. ``multiple``: every cut between parts falls on a multiple of it (a matrix product's
    rows or columns: see ``BLAS_TILE``). ``busy``: how many of the threads are taken by a task
    given ``later`` (one part fewer each). Shared, the slices run at once, one per BLAS thread
    the caller had, each in its own thread (the first in the caller's), under the caller's
    ``np.errstate``, with BLAS held to one thread until all are done. A part no other thread has
    started when the caller's own is done (the others are busy with work ``later``) is run by
    the caller. An error in a part is raised here.
    """
    most = min(n // multiple, work // SMALL)   # parts each of at least SMALL, cut on multiples
    threads = _threads(most > 1)
    count = min(threads - busy, most)
    if count <= 1:
        part(slice(0, n))
        return
    cuts = [i * (n // multiple) // count * multiple for i in range(count)] + [n]
    _run_parts(part, [slice(a, b) for a, b in zip(cuts, cuts[1:])], threads)


@contextlib.contextmanager
def deferred():
    """A scope for work that may be done ``later``: by its end every such task is done (the
    ones no other thread has started, here), and an error in one is raised. Nested, the
    outermost scope is the one that waits. The model's backward is one: the weight gradients
    are made on the other core while the chain of input gradients goes on, and fill the time
    it spends on one core (layer norm, the activation, sums)."""
    if _deferred.get() is not None:
        yield
        return
    tasks = []
    token = _deferred.set(tasks)
    failed = True
    try:
        yield
        failed = False
    finally:
        _deferred.reset(token)
        try:
            _finish(tasks, run_left=not failed)
        finally:
            if tasks:
                _let_go()
    _raise_first(tasks)


def settle() -> None:
    """Inside a ``deferred`` scope: every task given ``later`` so far done now (an error in one
    raised), the scope going on. A streamed backward reads each block's weight gradients (and
    drops them) before the next block's are made."""
    tasks = _deferred.get()
    if not tasks:
        return
    done = list(tasks)
    tasks.clear()
    try:
        _finish(done, run_left=True)
    finally:
        _let_go()
    _raise_first(done)


def later(task, work: int) -> bool:
    """Hand ``task()`` (about ``work`` multiply-adds, counted as ``run`` counts them) to another
    of tfm's threads, to be done while the caller goes on and before the ``deferred`` scope
    around ends; False (and the task not run) outside such a scope or when sharing does not pay
    (``run``): then the caller runs it. From the first task to the scope's end BLAS is held to
    one thread. A task runs whole: it is itself a core's part (every ``run`` in it is one
    part). Nothing may read what it writes before the scope ends."""
    tasks = _deferred.get()
    threads = _threads(work >= SMALL)
    if tasks is None or threads < 2:
        return False
    if not tasks:
        _hold(threads)
    tasks.append(_Task(task, whole=True))
    _queue(os.getpid()).put(tasks[-1], threads - 1, urgent=False)
    return True


def _threads(worth_sharing: bool) -> int:
    """The BLAS threads work may be shared over: 1 when it is not worth sharing, inside
    ``one_piece`` or a task run ``later``, or without an OpenBLAS whose threads tfm can hold;
    while tfm holds BLAS to one thread, the threads it had."""
    if not worth_sharing or _one_piece.get() or _whole.get():
        return 1
    control = blas_threads()
    if control is None:
        return 1
    return _held[1] if _held[0] else control[0]()


_lock = threading.Lock()
_held = [0, 1]   # how many hold BLAS to one thread, and the threads it is given back at the end


def _hold(threads: int) -> None:
    """BLAS to one thread, until every ``_hold`` has its ``_let_go``."""
    with _lock:
        if _held[0] == 0:
            blas_threads()[1](1)
            _held[1] = threads
        _held[0] += 1


def _let_go() -> None:
    with _lock:
        _held[0] -= 1
        if _held[0] == 0:
            blas_threads()[1](_held[1])


class _Task:
    """A call made once, by whichever thread takes it first, under its caller's np.errstate
    (an overflow is raised in another thread as it is in one piece); its error kept."""

    def __init__(self, call, whole: bool):
        self.call, self.whole, self.errors = call, whole, np.geterr()
        self.taken, self.error, self.done = False, None, threading.Event()

    def take(self) -> bool:
        with _lock:
            free, self.taken = not self.taken, True
        return free

    def run(self) -> None:
        token = _whole.set(self.whole)
        try:
            with np.errstate(**self.errors):
                self.call()
        except BaseException as error:  # noqa: BLE001 (raised by the thread that waits)
            self.error = error
        finally:
            _whole.reset(token)
            self.done.set()


class _Queue:
    """Tasks for tfm's threads: a part of a ``run`` before any task for ``later``. The threads
    are made as they are first needed, one per BLAS thread but the caller's, and kept off the
    caller's core (``_steer``)."""

    def __init__(self):
        self.urgent, self.later = collections.deque(), collections.deque()
        self.ready = threading.Condition()
        self.threads = 0
        self.natives = []      # the threads' ids in the operating system
        self.steered = None    # the core they were last kept off

    def put(self, task: _Task, threads: int, urgent: bool) -> None:
        with self.ready:
            (self.urgent if urgent else self.later).append(task)
            while self.threads < threads:
                thread = threading.Thread(target=self._serve, name=f"tfm_{self.threads}",
                                          daemon=True)
                thread.start()
                self.natives.append(thread.native_id)
                self.steered = None
                self.threads += 1
            self._steer()
            self.ready.notify()

    def _steer(self) -> None:
        """Let tfm's threads run on any of the caller's cores but the one it is on. Woken, a
        thread sometimes lands on the caller's core (this virtual machine wakes an idle core
        slowly), and the two share it until Linux moves one, milliseconds later: a part that
        took 9 ms took 15-18. Unsteered, 11 of 318 parts of 20 float32 steps began on the
        caller's core; with layer norm's short parts cut too, 53 of 416, and cutting them made
        the step 1.083 times as long (steered: 0.997). Steered, none did. The step as tfm
        cuts it took 0.992-1.011 of its steered time unsteered (paired, 40-100 rounds, both
        dtypes): no faster, but no part waits on where the system puts a thread. A system
        call only when the caller has moved; nothing where the system cannot say which core
        runs a thread."""
        core = _core()
        if core is None or core == self.steered:
            return
        others = os.sched_getaffinity(0) - {core}
        if not others:
            return
        for native in self.natives:
            try:
                os.sched_setaffinity(native, others)
            except OSError:   # not ours to move (a sandbox): leave it to the system
                return
        self.steered = core

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.urgent and not self.later:
                    self.ready.wait()
                task = (self.urgent or self.later).popleft()
            if task.take():
                task.run()


@functools.lru_cache(maxsize=1)
def _sched_getcpu():
    """libc's sched_getcpu, or None (a system with no way to set a thread's cores)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    import ctypes  # here, not at import (start-up)
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None


def _core():
    """The core the calling thread runs on, or None when the system cannot say."""
    getcpu = _sched_getcpu()
    if getcpu is None:
        return None
    core = getcpu()
    return None if core < 0 else core


@functools.lru_cache(maxsize=1)
def _queue(pid: int) -> _Queue:
    """One per process: a child made by fork has none of its parent's threads, so it makes its
    own (``pid``)."""
    return _Queue()


def _run_parts(part, pieces, threads: int):
    """``part(piece)`` for every piece at once: the first here, the others in tfm's threads (or
    here, if none has started one by the time the first is done), with BLAS held to one thread
    until all are done. The parts' errors are raised here."""
    _hold(threads)
    try:
        tasks = [_Task(functools.partial(part, piece), whole=False) for piece in pieces[1:]]
        queue = _queue(os.getpid())
        for task in tasks:
            queue.put(task, threads - 1, urgent=True)
        failed = True
        try:
            part(pieces[0])
            failed = False
        finally:
            _finish(tasks, run_left=not failed)
    finally:
        _let_go()
    _raise_first(tasks)


def _finish(tasks, run_left: bool) -> None:
    """Every one of ``tasks`` done: those no thread has begun run here (after an error, they
    are dropped), the others waited for."""
    for task in tasks:
        if task.take():
            if run_left:
                task.run()
            else:
                task.done.set()
    for task in tasks:
        task.done.wait()


def _raise_first(tasks) -> None:
    for task in tasks:
        if task.error is not None:
            raise task.error


def unbuffered(row_bytes: int):
    """NumPy's element-wise work inside (a with block, or a function it decorates) without
    NumPy's buffer, when it goes over rows of ``row_bytes`` or more that are not one
    contiguous run: a row (a bias, gamma) or a column (a row's mean) broadcast over a matrix,
    a block of the scores, a column part of a product. A ufunc copies such operands through
    a buffer of 8,192 entries, to call its loop on longer runs, and on long rows the copies
    cost more than the calls they save. Given a buffer shorter than a row, it runs its loop
    on each row where it is. In float64, a bias added to a column half of a (1024, 2048)
    product took 1.03 ms buffered and 0.38 unbuffered; at the bench's size layer norm took
    1.19-1.26 times as long buffered, attention 1.05, the step 1.02 (paired, 40 rounds,
    twice; float32's step 1.01, within the noise). The same numbers, bit for bit (from NumPy
    2.3; before, the buffer is left alone: see BUFFER_FREE_SUMS). Rows under 3 KiB gain
    nothing or lose (a (512, 128) bias add: 29 us buffered, 52 unbuffered): they stay
    buffered. Not for a sum down the columns (axis 0), which the buffer speeds up."""
    if row_bytes < LONG_ROW or not BUFFER_FREE_SUMS:
        return _AS_IT_IS
    return _small_buffer()


class _Buffered:
    """``unbuffered``'s answer for short rows: the buffer left as it is, at no cost (a with
    block, or a decorator that returns the function itself). A generator's context costs
    3-4 us a use, and the toy model's forward uses a dozen (279 us in all)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False

    def __call__(self, function):
        return function


_AS_IT_IS = _Buffered()


@contextlib.contextmanager
def _small_buffer():
    size = np.setbufsize(UNBUFFERED)   # this context's: each thread has its own
    try:
        yield
    finally:
        np.setbufsize(size)


def thin(*shapes) -> bool:
    """Whether a matrix product of these operand shapes has a side under ``THIN``."""
    return min(map(min, shapes)) < THIN


def matmul(a, b, out, add=None, busy: int = 0) -> None:
    """``out = a @ b`` (+ ``add``, a row vector or a number, if given) for 2-D arrays, in parts
    of a's rows or of b's columns, whichever are more: each part packs the operand it shares
    whole, so that one should be the smaller (``run``). A thin product (a side under ``THIN``)
    stays whole, on BLAS's own threads, which ran those faster than parts did (GPT-2's shapes
    on 32 tokens: 32 rows, or a weight gradient summed over 32 rows). ``busy``: see ``run``."""
    m, k = a.shape
    n = b.shape[1]
    if add is not None and np.shape(add) != (n,):   # a number: a row of it
        add = np.broadcast_to(add, (n,))

    def rows(r):
        np.matmul(a[r], b, out=out[r])
        if add is not None:
            with unbuffered(n * out.itemsize):
                out[r] += add

    def columns(c):
        np.matmul(a, b[:, c], out=out[:, c])
        if add is not None:
            with unbuffered(len(range(n)[c]) * out.itemsize):
                out[:, c] += add[c]

    if thin(a.shape, b.shape):
        rows(slice(0, m))
    elif m >= n:
        run(rows, m, cost(m * k * n, out.dtype), BLAS_TILE, busy)
    else:
        run(columns, n, cost(m * k * n, out.dtype), BLAS_TILE, busy)
