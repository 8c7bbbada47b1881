"""tfmcli.engine.parallel: work cut into parts that cover it once, run at once in threads with BLAS
held to one thread and restored after, errors and np.errstate carried across; and the operations
that use it give the numbers they give in one piece: exactly where the parts are heads or rows of
element-wise work, to rounding where BLAS products are cut (BLAS tiles a part as it likes, as it
does for its own thread count)."""

import os
import signal
import sys
import threading

import numpy as np
import pytest
from test_fast import TOL, rel

import tfmcli
from helpers import assert_scaled_close, random_params
from tfmcli.engine import model, ops, parallel


class FakeBlas:
    """(get, set) as parallel.blas_threads gives them, counting what was set."""

    def __init__(self, threads):
        self.threads, self.log = threads, []

    def get(self):
        return self.threads

    def set(self, n):
        self.log.append(n)
        self.threads = n


@pytest.fixture
def blas(monkeypatch):
    """BLAS with 3 threads, and sharing from the smallest work and the thinnest product: every
    operation is cut."""
    fake = FakeBlas(3)
    monkeypatch.setattr(parallel, "blas_threads", lambda: (fake.get, fake.set))
    monkeypatch.setattr(parallel, "SMALL", 1)
    monkeypatch.setattr(parallel, "THIN", 1)
    return fake


def serial(part, n, work, multiple=1, busy=0):
    part(slice(0, n))


def record_parts(n, work, multiple=1, at_once=1):
    """The (start, stop, thread) of every part of a run; with ``at_once``, each part waits
    until that many have begun (a part that never gets a thread of its own breaks the wait)."""
    seen = []
    lock = threading.Lock()
    together = threading.Barrier(at_once, timeout=10)

    def part(s):
        with lock:
            seen.append((s.start, s.stop, threading.current_thread().name))
        together.wait()

    parallel.run(part, n, work, multiple)
    return sorted(seen)


def test_parts_cover_the_range_once_cut_on_multiples(blas):
    parts = record_parts(1000, 10 ** 9, multiple=64, at_once=3)   # all three at once
    assert [(a, b) for a, b, _ in parts] == [(0, 320), (320, 640), (640, 1000)]
    caller = threading.current_thread().name                 # the first part here, the rest
    assert [name == caller for _, _, name in parts] == [True, False, False]   # in tfm's own
    assert all(name.startswith("tfm") for _, _, name in parts[1:])
    assert blas.log == [1, 3]                                 # held to one, then given back
    assert blas.threads == 3


def test_no_more_parts_than_multiples_work_or_threads(blas, monkeypatch):
    assert [(a, b) for a, b, _ in record_parts(100, 10 ** 9, multiple=64)] == [(0, 100)]
    assert [(a, b) for a, b, _ in record_parts(2, 10 ** 9)] == [(0, 1), (1, 2)]
    monkeypatch.setattr(parallel, "SMALL", 1000)
    assert [(a, b) for a, b, _ in record_parts(10, 2999)] == [(0, 5), (5, 10)]
    assert [(a, b) for a, b, _ in record_parts(10, 999)] == [(0, 10)]
    assert blas.log == [1, 3, 1, 3]                            # one part: BLAS left alone


def test_one_blas_thread_or_none_found_means_one_part(monkeypatch):
    monkeypatch.setattr(parallel, "SMALL", 1)
    held = FakeBlas(1)                                         # the user holds BLAS to one
    monkeypatch.setattr(parallel, "blas_threads", lambda: (held.get, held.set))
    assert record_parts(10, 10 ** 9) == [(0, 10, threading.current_thread().name)]
    monkeypatch.setattr(parallel, "blas_threads", lambda: None)
    assert record_parts(10, 10 ** 9) == [(0, 10, threading.current_thread().name)]
    assert held.log == []


def test_an_error_in_a_part_is_raised_and_blas_given_back(blas):
    def part(s):
        if s.start > 0:
            raise ValueError(f"part at {s.start}")

    with pytest.raises(ValueError, match="part at 3"):
        parallel.run(part, 9, 10 ** 9)
    assert blas.threads == 3


def test_a_part_runs_under_the_callers_errstate(blas):
    """The CLI stops a run that overflows (np.errstate(over="raise")): a part in another
    thread must raise too, and under "ignore" must not."""
    x = np.array([1.0, 1.0, 1.0, 1.0, 1e308, 1e308])   # overflows in the last part only

    def part(s):
        x[s] * 10.0

    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        parallel.run(part, 6, 10 ** 9)
    with np.errstate(over="ignore"):
        parallel.run(part, 6, 10 ** 9)


def test_numpys_own_openblas_is_found_and_held():
    """NumPy's wheels bundle OpenBLAS (the README's install): tfm must find it, or it runs on
    one core without saying so."""
    deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    if "openblas" not in deps.get("name", "") or not deps.get("found"):
        pytest.skip(f"NumPy's BLAS here is {deps.get('name')}")
    control = parallel.blas_threads()
    assert control is not None
    get, set_ = control
    before = get()
    set_(1)
    try:
        assert get() == 1
    finally:
        set_(before)
    assert get() == before


def test_one_piece_cuts_nothing_and_leaves_blas_alone(blas, monkeypatch):
    cut = count_cuts(monkeypatch)
    with parallel.one_piece():
        assert [(a, b) for a, b, _ in record_parts(9, 10 ** 9)] == [(0, 9)]
    assert blas.log == [] and cut == []
    assert [(a, b) for a, b, _ in record_parts(9, 10 ** 9)] == [(0, 3), (3, 6), (6, 9)]


def test_one_blas_thread_holds_blas_inside_and_gives_it_back(blas):
    with parallel.one_blas_thread():
        assert blas.threads == 1
        with parallel.one_blas_thread():                     # nested: held once
            assert blas.threads == 1
        assert blas.threads == 1
    assert blas.log == [1, 3] and blas.threads == 3
    with pytest.raises(ZeroDivisionError), parallel.one_blas_thread():
        1 / 0                                               # given back after an error too
    assert blas.log == [1, 3, 1, 3]
    with parallel.one_piece(), parallel.one_blas_thread():  # the reference path: left alone
        assert blas.threads == 3
    assert blas.log == [1, 3, 1, 3]


def test_the_reference_path_is_plain_numpy(blas, monkeypatch):
    """forward(..., fast=False) and its backward: one piece, BLAS left as it is."""
    cut = count_cuts(monkeypatch)
    cfg = tfmcli.Config(batch=2, seq_len=6, d_model=12, heads=3, vocab=11)
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg, fast=False)
    tfmcli.backward(tfmcli.init_params(cfg), fwd, cfg)
    assert blas.log == [] and cut == []


# ---------------------------------------------------------------- the operations, cut


def count_cuts(monkeypatch):
    """A list that gets the slices of every run that was cut into parts."""
    cuts = []
    real = parallel._run_parts

    def counting(part, pieces, threads):
        cuts.append(pieces)
        real(part, pieces, threads)

    monkeypatch.setattr(parallel, "_run_parts", counting)
    return cuts


def rng_arrays(seed, *shapes, dtype="float64"):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cache_bytes", [ops.CACHE_BYTES, 1])   # 1: a sequence at a time
def test_attention_in_parts_of_heads_is_exactly_attention_in_one(blas, monkeypatch, dtype,
                                                                  cache_bytes):
    B, H, T, dh = 3, 5, 9, 4
    q, k, v, dctx = rng_arrays(1, *[(B, H, T, dh)] * 4, dtype=dtype)
    cfg = tfmcli.Config(batch=B, seq_len=T, d_model=H * dh, heads=H, causal=True,
                        lengths=(9, 4, 6))
    from tfmcli.engine.model import _fast_mask
    mask = _fast_mask(cfg.lengths, T, True, dtype, 2)
    monkeypatch.setattr(ops, "CACHE_BYTES", cache_bytes)
    cut = ops.attention_forward_fast(q, k, v, mask, 0.5)
    cut_back = ops.attention_backward_fast(dctx, cut[2])
    assert blas.log == [1, 3, 1, 3]
    monkeypatch.setattr(parallel, "run", serial)
    monkeypatch.setattr(ops, "CACHE_BYTES", 1 << 40)                # the whole batch at once
    whole = ops.attention_forward_fast(q, k, v, mask, 0.5)
    whole_back = ops.attention_backward_fast(dctx, whole[2])
    for a, b in [*zip(cut[:2], whole[:2]), (cut[2].pattern, whole[2].pattern),
                 *zip(cut_back, whole_back)]:
        np.testing.assert_array_equal(a, b)


def test_attention_takes_as_many_sequences_at_once_as_stay_in_cache():
    """A sequence at a time where its block of scores alone fills the cache (the bench's
    block: 4 heads x 128 queries x 512 keys, 1 MiB in float32), the whole batch where
    sequences are short (tfm train's: 32 sequences of 16 tokens, 2 heads)."""
    assert ops._sequences(2, 4, 512, 4) == [slice(0, 1), slice(1, 2)]
    assert ops._sequences(3, 4, 512, 8) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert ops._sequences(5, 4, 256, 4) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert ops._sequences(32, 2, 16, 8) == [slice(0, 256)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_layer_norm_in_parts_is_exactly_layer_norm_in_one(blas, monkeypatch, dtype):
    x, dout = rng_arrays(2, (3, 7, 10), (3, 7, 10), dtype=dtype)
    gamma, beta = rng_arrays(3, (10,), (10,), dtype=dtype)
    out, cache = ops.layer_norm_forward_fast(x, gamma, beta, 1e-5)
    back = ops.layer_norm_backward_fast(dout, cache)
    assert blas.log == [1, 3] * 2                 # the forward's rows, the backward's rows
    monkeypatch.setattr(parallel, "run", serial)
    out1, cache1 = ops.layer_norm_forward_fast(x, gamma, beta, 1e-5)
    back1 = ops.layer_norm_backward_fast(dout, cache1)
    for a, b in [(out, out1), *zip(cache, cache1), *zip(back, back1)]:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows, d_in, d_out", [(7, 5, 4), (4, 6, 11), (130, 9, 70)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_in_parts_equals_linear_in_one(blas, monkeypatch, rows, d_in, d_out, transposed,
                                              bias):
    """The forward's product in parts of rows or columns, dx in one part fewer (dW is made whole
    on another thread meanwhile), db in parts of its columns; with a bias and with the number
    0.0 a head without one has."""
    monkeypatch.setattr(parallel, "BLAS_TILE", 2)
    x, W, b, dout = rng_arrays(4, (rows, d_in), (d_in, d_out), (d_out,), (rows, d_out))
    b = b if bias else 0.0
    cut = count_cuts(monkeypatch)
    out, cache = ops.linear_forward(x, W, b)
    back = ops.linear_backward(dout, cache, transposed)
    assert [len(pieces) for pieces in cut] == [3, 2, 3]        # x W; dx (dW whole); db
    monkeypatch.setattr(parallel, "run", serial)
    out1, cache1 = ops.linear_forward(x, W, b)
    back1 = ops.linear_backward(dout, cache1, transposed)
    assert_scaled_close(out, x @ W + b)
    np.testing.assert_allclose(back[1], dout.T @ x if transposed else x.T @ dout, rtol=1e-12)
    for a, b_ in [(out, out1), *zip(back, back1)]:
        assert rel(a, b_) <= TOL


@pytest.mark.parametrize("norm, activation, tied", [("pre", "relu", False), ("post", "gelu", True)])
def test_a_model_in_parts_equals_the_model_in_one(blas, monkeypatch, norm, activation, tied):
    """At random O(1) parameters, with padding: every activation and gradient."""
    cfg = tfmcli.Config(batch=2, seq_len=6, d_model=12, heads=3, vocab=11, norm=norm,
                        activation=activation, causal=True, lengths=(6, 3), tied_head=tied,
                        head_bias=not tied, layers=2, seed=3)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    monkeypatch.setattr(model, "THREADED_ROWS", 1)   # a step this small runs in one piece
    cut = count_cuts(monkeypatch)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert len(cut) > 20
    monkeypatch.setattr(parallel, "run", serial)
    fwd1 = tfmcli.forward(params, inputs, cfg)
    grads1 = tfmcli.backward(params, fwd1, cfg)
    assert abs(fwd.loss - fwd1.loss) <= TOL * abs(fwd1.loss)
    floor = max(float(np.abs(g).max()) for g in grads1.values())
    for name in fwd1.acts:
        assert rel(fwd.acts[name], fwd1.acts[name]) <= TOL, name
    for name in grads1:
        assert rel(grads[name], grads1[name], floor) <= TOL, name
    for name in grads1.acts:
        assert rel(grads.acts[name], grads1.acts[name]) <= TOL, name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_makes_its_own_threads(blas):
    """A child made by fork has none of its parent's threads: parts sent to the parent's pool
    would never run, and the child would wait for ever (it is killed after 20 s here)."""
    record_parts(10, 10 ** 9)                                  # the parent's pool exists
    pid = os.fork()
    if pid == 0:                                               # the child
        signal.alarm(20)
        try:
            code = 0 if len(record_parts(10, 10 ** 9)) == 3 else 1
        finally:
            os._exit(locals().get("code", 2))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


STEERABLE = hasattr(os, "sched_setaffinity") and parallel._core() is not None


def test_the_core_a_thread_is_on_is_any_the_system_names_from_0(monkeypatch):
    """Core 0 is a core like the others (a thread there must be steered from too); -1 is the
    system's error, and a system with no sched_getcpu says nothing."""
    for answer, core in ((0, 0), (1, 1), (-1, None)):
        monkeypatch.setattr(parallel, "_sched_getcpu", lambda answer=answer: lambda: answer)
        assert parallel._core() == core
    monkeypatch.setattr(parallel, "_sched_getcpu", lambda: None)
    assert parallel._core() is None


@pytest.mark.skipif(not STEERABLE or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and a system that sets a thread's cores")
def test_tfms_threads_are_kept_off_the_callers_core(blas):
    """While its parts run, every thread of tfm's may run on any of the caller's cores but the
    one the caller is on. (Tried three times: the caller may move between handing the parts
    over and looking at its core, microseconds apart.)"""
    queue = parallel._queue(os.getpid())
    everywhere = os.sched_getaffinity(0)
    try:
        for _ in range(3):
            seen, together = {}, threading.Barrier(3, timeout=10)

            def part(s):
                seen[threading.get_native_id()] = (parallel._core(), os.sched_getaffinity(0))
                together.wait()                               # three parts in three threads

            parallel.run(part, 3, 3)
            caller, _ = seen.pop(threading.get_native_id())
            if all(allowed == everywhere - {caller} for _, allowed in seen.values()):
                break
        assert len(seen) == 2
        for core, allowed in seen.values():
            assert allowed == everywhere - {caller}
            assert core != caller
    finally:
        for native in queue.natives:                           # as the threads were made
            os.sched_setaffinity(native, everywhere)
        queue.steered = None


def test_a_thin_product_stays_whole(blas, monkeypatch):
    """A product with a side under THIN (32 rows, or a gradient summed over 32 rows) runs on
    BLAS's own threads, which ran those faster than parts did."""
    monkeypatch.setattr(parallel, "THIN", 256)
    cut = count_cuts(monkeypatch)
    a, b, thin_a, thin_b = rng_arrays(5, (256, 300), (300, 256), (32, 300), (300, 32))
    for left, right in [(thin_a, b), (a, thin_b), (b.T, thin_a.T)]:   # few rows, columns, or K
        out = np.empty((left.shape[0], right.shape[1]))
        parallel.matmul(left, right, out, add=1.0)
        assert_scaled_close(out, left @ right + 1.0)
    assert cut == []
    out = np.empty((256, 256))
    parallel.matmul(a, b, out, add=1.0)
    assert [[(s.start, s.stop) for s in c] for c in cut] == [[(0, 64), (64, 128), (128, 256)]]
    assert_scaled_close(out, a @ b + 1.0)


@pytest.mark.parametrize("transposed", [False, True])
def test_linear_backward_on_two_cores_makes_dx_and_dW_at_once(monkeypatch, transposed):
    """Each product whole, one per thread, at once: the same numbers as one after the other."""
    monkeypatch.setattr(parallel, "SMALL", 1)
    monkeypatch.setattr(parallel, "THIN", 1)
    fake = FakeBlas(2)
    monkeypatch.setattr(parallel, "blas_threads", lambda: (fake.get, fake.set))
    x, W, dout = rng_arrays(6, (40, 9), (9, 13), (40, 13))
    cache = ops.LinearCache(x, W)
    threads = []
    both = threading.Barrier(2, timeout=10)                   # neither ends before both began
    real_matmul = parallel.matmul

    def matmul(*args, **kwargs):
        threads.append(threading.current_thread().name)
        both.wait()
        real_matmul(*args, **kwargs)

    monkeypatch.setattr(parallel, "matmul", matmul)
    back = ops.linear_backward(dout, cache, transposed)
    assert len(set(threads)) == 2 and fake.log == [1, 2]
    monkeypatch.setattr(parallel, "matmul", real_matmul)
    with parallel.one_piece():
        whole = ops.linear_backward(dout, cache, transposed)
    for a, b in zip(back, whole):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- work done later


@pytest.fixture
def two_cores(monkeypatch):
    """BLAS with 2 threads, so tfm one thread of its own (a queue of its own: one made by
    tests before with more threads would have more), and sharing from the smallest work."""
    fake = FakeBlas(2)
    monkeypatch.setattr(parallel, "blas_threads", lambda: (fake.get, fake.set))
    monkeypatch.setattr(parallel, "SMALL", 1)
    parallel._queue.cache_clear()
    yield fake
    parallel._queue.cache_clear()


class Blocker:
    """A task that says when it has begun, then waits to be let go."""

    def __init__(self):
        self.began, self.go, self.thread = threading.Event(), threading.Event(), None

    def __call__(self):
        self.thread = threading.current_thread().name
        self.began.set()
        assert self.go.wait(10)


def test_a_task_given_later_runs_in_another_thread_while_the_caller_goes_on(two_cores):
    task = Blocker()
    with parallel.deferred():
        assert parallel.later(task, 10 ** 9)
        assert task.began.wait(10)          # begun while the caller is still in the scope
        assert two_cores.log == [1]         # BLAS held to one thread meanwhile
        task.go.set()
    assert task.thread.startswith("tfm")
    assert two_cores.log == [1, 2]


def test_later_hands_nothing_over_outside_a_scope_on_one_core_or_for_small_work(two_cores):
    ran = []
    assert not parallel.later(lambda: ran.append(1), 10 ** 9)        # no scope
    with parallel.deferred():
        assert not parallel.later(lambda: ran.append(1), 0)          # less than SMALL
        with parallel.one_piece():
            assert not parallel.later(lambda: ran.append(1), 10 ** 9)
    two_cores.threads = 1
    with parallel.deferred():
        assert not parallel.later(lambda: ran.append(1), 10 ** 9)    # BLAS on one thread
    assert ran == [] and two_cores.log == []


def test_the_outermost_scope_waits_for_its_tasks(two_cores):
    task = Blocker()
    with parallel.deferred():
        with parallel.deferred():
            parallel.later(task, 10 ** 9)
        assert task.began.wait(10)
        assert not task.go.is_set()         # the inner scope ended without waiting
        task.go.set()
    assert task.thread.startswith("tfm") and two_cores.log == [1, 2]


def test_the_caller_runs_what_no_thread_has_begun(two_cores):
    """tfm's one thread (two cores) busy: a part of a run, and a task left at the scope's end,
    are run by the caller rather than waited for."""
    busy, parts = Blocker(), []
    with parallel.deferred():
        parallel.later(busy, 10 ** 9)
        assert busy.began.wait(10)
        parallel.run(lambda s: parts.append((s.start, threading.current_thread().name)), 4,
                     10 ** 9)
        left = []
        parallel.later(lambda: (left.append(threading.current_thread().name), busy.go.set()),
                       10 ** 9)
    caller = threading.current_thread().name
    assert sorted(parts) == [(0, caller), (2, caller)]
    assert left == [caller]


def test_tfms_thread_takes_a_part_of_a_run_before_a_task_given_later(two_cores):
    """The caller's run waits on its other part; a queued dW must not go first."""
    busy, order = Blocker(), []
    second_began = threading.Event()

    def part(s):
        if s.start == 0:          # the caller's: frees tfm's thread, then needs the other part
            busy.go.set()
            assert second_began.wait(5), "the part waited behind the task given later"
        else:
            order.append("part")
            second_began.set()

    with parallel.deferred():
        parallel.later(busy, 10 ** 9)
        assert busy.began.wait(10)
        parallel.later(lambda: order.append("task"), 10 ** 9)     # queued first
        parallel.run(part, 2, 10 ** 9)
    assert order[0] == "part"


def test_after_an_error_what_no_thread_has_begun_is_dropped(two_cores):
    """An error in the scope (or in the caller's own part of a run) is raised at once: the
    tasks left are not run first."""
    busy, ran = Blocker(), []
    with pytest.raises(KeyError), parallel.deferred():
        parallel.later(busy, 10 ** 9)
        assert busy.began.wait(10)
        parallel.later(lambda: ran.append("task"), 10 ** 9)
        threading.Timer(0.5, busy.go.set).start()             # long after the drop
        raise KeyError("in the scope")
    assert ran == [] and two_cores.log == [1, 2]

    def part(s):
        if s.start == 0:
            raise KeyError("in the caller's part")
        ran.append("part")

    busy = Blocker()
    with parallel.deferred():
        parallel.later(busy, 10 ** 9)
        assert busy.began.wait(10)
        with pytest.raises(KeyError):
            parallel.run(part, 2, 10 ** 9)                    # the other part: not begun
        busy.go.set()
    assert ran == []


def test_a_task_given_later_is_one_part(two_cores):
    parts = []
    with parallel.deferred():
        parallel.later(lambda: parallel.run(lambda s: parts.append((s.start, s.stop)), 8,
                                            10 ** 9), 10 ** 9)
    assert parts == [(0, 8)]


def test_an_error_in_a_task_given_later_is_raised_at_the_scope_end(two_cores):
    x = np.array([1e308])
    with pytest.raises(FloatingPointError), np.errstate(over="raise"), parallel.deferred():
        parallel.later(lambda: x * 10.0, 10 ** 9)           # raises under the caller's errstate
    with np.errstate(over="ignore"), parallel.deferred():
        parallel.later(lambda: x * 10.0, 10 ** 9)
    with pytest.raises(ZeroDivisionError), parallel.deferred():
        parallel.later(lambda: 1 / 0, 10 ** 9)
    assert two_cores.threads == 2


def test_the_models_backward_hands_every_weight_gradient_over_once(two_cores, monkeypatch):
    """A block has six weight matrices and the head one: seven tasks given later in one scope,
    BLAS held to one thread from the first to the end of the backward."""
    monkeypatch.setattr(parallel, "THIN", 1)
    monkeypatch.setattr(model, "THREADED_ROWS", 1)   # a step this small runs in one piece
    cfg = tfmcli.Config(batch=2, seq_len=6, d_model=12, heads=3, vocab=11, seed=3)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    handed = []
    real_later = parallel.later
    monkeypatch.setattr(parallel, "later", lambda task, work: handed.append(
        parallel._deferred.get()) or real_later(task, work))
    two_cores.log.clear()
    tfmcli.backward(params, fwd, cfg)
    assert len(handed) == 7 and all(scope is handed[0] for scope in handed)
    assert two_cores.log == [1, 2]


def test_a_product_is_cut_only_into_parts_of_SMALL_multiply_adds(blas, monkeypatch):
    """With tfm's own thresholds: 512^3 (4 parts' worth) is cut in three, one per thread;
    256^3 (half a part's worth) stays whole."""
    monkeypatch.setattr(parallel, "SMALL", 1 << 25)
    monkeypatch.setattr(parallel, "THIN", 256)
    cut = count_cuts(monkeypatch)
    for n in (256, 512):
        a, b = rng_arrays(7, (n, n), (n, n))
        out = np.empty((n, n))
        parallel.matmul(a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-12)
    assert [[(s.start, s.stop) for s in c] for c in cut] == [[(0, 128), (128, 320), (320, 512)]]


def test_a_wide_product_is_cut_in_columns_by_the_same_work(blas, monkeypatch):
    """(256, 512) @ (512, 1024) is 2^27 multiply-adds, counted 2^28 in float64, eight parts'
    worth: three parts of b's columns (there are more columns than rows), cut on multiples of
    BLAS_TILE; on 32 rows it is one part's worth, and stays whole."""
    monkeypatch.setattr(parallel, "SMALL", 1 << 25)
    monkeypatch.setattr(parallel, "THIN", 16)
    cut = count_cuts(monkeypatch)
    for m in (256, 32):
        a, b = rng_arrays(8, (m, 512), (512, 1024))
        out = np.empty((m, 1024))
        parallel.matmul(a, b, out, add=np.arange(1024.0))
        np.testing.assert_allclose(out, a @ b + np.arange(1024.0), rtol=1e-12)
    assert [[(s.start, s.stop) for s in c] for c in cut] == [[(0, 320), (320, 640), (640, 1024)]]


def test_attention_is_cut_from_two_parts_of_SMALL(blas, monkeypatch):
    """B H T T d_head multiply-adds a product: (1, 2, 512, 128) is 2^26, two parts' worth in
    float32; (1, 2, 512, 64) is one, and two in float64 (``cost``). The backward alike."""
    monkeypatch.setattr(parallel, "SMALL", 1 << 25)
    cut = count_cuts(monkeypatch)
    from tfmcli.engine.model import _fast_mask
    for T, dh, dtype in [(512, 128, "float32"), (512, 64, "float32"), (512, 64, "float64")]:
        q, k, v = rng_arrays(8, *[(1, 2, T, dh)] * 3, dtype=dtype)
        context, _, cache = ops.attention_forward_fast(
            q, k, v, _fast_mask((T,), T, True, dtype, 128), 0.1)
        ops.attention_backward_fast(context, cache)
    assert [[(s.start, s.stop) for s in c] for c in cut] == [[(0, 1), (1, 2)]] * 4


@pytest.mark.parametrize("passes, small, cuts", [
    (6, 0, [2]), (6, 1, []),     # the forward: six passes over its rows
    (7, 0, [2]), (7, 1, []),     # the backward: seven
])
def test_layer_norm_is_cut_from_two_SMALLs_of_its_passes(blas, monkeypatch, passes, small, cuts):
    """Layer norm counts ``PASS`` a pass over an entry: when its passes are exactly two SMALLs
    its rows go in two parts; with SMALL one larger they stay whole."""
    x, dout = rng_arrays(2, (8, 16), (8, 16), dtype="float32")
    gamma, beta = rng_arrays(3, (16,), (16,), dtype="float32")
    monkeypatch.setattr(parallel, "SMALL", x.size * passes * parallel.PASS // 2 + small)
    cut = count_cuts(monkeypatch)
    out, cache = ops.layer_norm_forward_fast(x, gamma, beta, 1e-5)
    forward = [len(c) for c in cut]
    cut.clear()
    ops.layer_norm_backward_fast(dout, cache)
    backward = [len(c) for c in cut]
    assert (forward if passes == 6 else backward) == cuts


def test_float64_counts_as_twice_the_work_of_float32(blas, monkeypatch):
    """SMALL is a length of time, and a float64 number takes twice a float32's (products at
    half the rate, passes over twice the bytes): layer norm at a size where float32's rows stay
    whole is cut in float64, and gives the numbers it gives whole."""
    assert parallel.cost(1000, np.float32) == 1000 and parallel.cost(1000, "float64") == 2000
    x, dout = rng_arrays(2, (8, 16), (8, 16))
    monkeypatch.setattr(parallel, "SMALL", x.size * 7 * parallel.PASS // 2 + 1)   # the backward
    cut = count_cuts(monkeypatch)
    gamma, beta = rng_arrays(3, (16,), (16,))
    results = {}
    for dtype in ("float32", "float64"):
        args = [a.astype(dtype) for a in (x, gamma, beta)]
        out, cache = ops.layer_norm_forward_fast(*args, 1e-5)
        results[dtype] = out, ops.layer_norm_backward_fast(dout.astype(dtype), cache)[0]
    parts = [(0, 2), (2, 5), (5, 8)]                          # one per thread: float64's
    assert [[(s.start, s.stop) for s in c] for c in cut] == [parts] * 2   # forward, backward
    with parallel.one_piece():
        out, cache = ops.layer_norm_forward_fast(x, gamma, beta, 1e-5)
        whole = out, ops.layer_norm_backward_fast(dout, cache)[0]
    for a, b in zip(results["float64"], whole):
        np.testing.assert_array_equal(a, b)


def test_a_weight_gradient_is_handed_over_from_SMALL_multiply_adds_of_float32(two_cores,
                                                                             monkeypatch):
    """With tfm's own thresholds: a (256, 256) layer's dW is 2^24 multiply-adds, half a part's
    worth in float32 (made here, after dx) and a whole one in float64 (``cost``: handed to
    tfm's thread); the bench's (1024, 512) -> 512 is 2^28, handed over in either."""
    monkeypatch.setattr(parallel, "SMALL", 1 << 25)
    monkeypatch.setattr(parallel, "THIN", 256)
    handed = []
    real_later = parallel.later
    monkeypatch.setattr(parallel, "later", lambda task, work: handed.append(
        real_later(task, work)) or handed[-1])
    for rows, d, dtype in [(256, 256, "float32"), (256, 256, "float64"), (1024, 512, "float32")]:
        x, W, dout = rng_arrays(9, (rows, d), (d, d), (rows, d), dtype=dtype)
        dx, dW, db = ops.linear_backward(dout, ops.LinearCache(x, W))
        np.testing.assert_allclose(dW, x.T @ dout, rtol=1e-4)
    assert handed == [False, True, True]


def test_a_bias_gradient_is_cut_from_two_parts_of_SMALL_passes(blas, monkeypatch):
    """db, a sum down the rows of dout, is one element-wise pass (``PASS`` an entry): at
    (64, 32) in float32 that is 2^15, two parts' worth of a SMALL of 2^14, so its 32 columns
    are summed in two parts, one per thread; half as many entries stay whole. The products are
    kept whole here (THIN), so the cuts seen are db's alone."""
    monkeypatch.setattr(parallel, "SMALL", 1 << 14)
    monkeypatch.setattr(parallel, "THIN", 1 << 20)
    cut = count_cuts(monkeypatch)
    for rows in (64, 32):
        x, W, dout = rng_arrays(11, (rows, 8), (8, 32), (rows, 32), dtype="float32")
        db = ops.linear_backward(dout, ops.LinearCache(x, W))[2]
        np.testing.assert_array_equal(db, np.add.reduce(dout, axis=0))
    assert [[(s.start, s.stop) for s in c] for c in cut] == [[(0, 16), (16, 32)]]


def test_a_run_makes_one_thread_for_each_blas_thread_but_the_callers(blas):
    """Three BLAS threads: the caller runs a part, and tfm makes two threads of its own (its
    queue made afresh here), not more."""
    parallel._queue.cache_clear()
    try:
        parts = record_parts(6, 10 ** 9, at_once=3)
        assert len(parts) == 3
        assert parallel._queue(os.getpid()).threads == 2
    finally:
        parallel._queue.cache_clear()


@pytest.mark.skipif(not parallel.BUFFER_FREE_SUMS, reason="NumPy before 2.3: left buffered")
def test_unbuffered_shrinks_numpys_buffer_for_long_rows_only_and_gives_it_back():
    default = np.getbufsize()
    with parallel.unbuffered(parallel.LONG_ROW):
        assert np.getbufsize() == parallel.UNBUFFERED
    assert np.getbufsize() == default
    with parallel.unbuffered(parallel.LONG_ROW - 1):          # a short row: left buffered
        assert np.getbufsize() == default
    with pytest.raises(ZeroDivisionError), parallel.unbuffered(parallel.LONG_ROW):
        1 / 0
    assert np.getbufsize() == default                          # given back after an error too

    @parallel.unbuffered(parallel.LONG_ROW)                   # as a decorator, in a thread
    def inside():
        return np.getbufsize()

    seen = []
    thread = threading.Thread(target=lambda: seen.append(inside()))
    thread.start()
    thread.join()
    assert seen == [parallel.UNBUFFERED] and inside() == parallel.UNBUFFERED
    assert np.getbufsize() == default

    @parallel.unbuffered(parallel.LONG_ROW - 1)               # short rows, as a decorator
    def short(x):
        return np.getbufsize(), x

    assert short(3) == (default, 3)
    with pytest.raises(ZeroDivisionError), parallel.unbuffered(8):   # an error goes through
        1 / 0


def test_a_buffered_broadcast_gives_the_same_bits_unbuffered():
    """A row and a column broadcast over a block whose rows are apart, and its row sums (which
    NumPy before 2.3 cut by the buffer's size: there unbuffered leaves the buffer alone)."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((2, 3, 64, 640))
    block, bias = scores[:, 1:, 5:40, :600], rng.standard_normal(600)

    def work():
        shifted = (block - block.max(axis=-1, keepdims=True)) * bias
        return shifted / shifted.sum(axis=-1, keepdims=True)

    buffered = work()
    with parallel.unbuffered(600 * 8):
        unbuffered = work()
    np.testing.assert_array_equal(unbuffered, buffered)


def test_the_fast_path_runs_unbuffered_where_rows_are_long_and_gives_the_same_bits(
        blas, monkeypatch):
    """Long rows (4 KiB in float64: 512 keys, a d_model of 512, thirds of a bias of 1536)
    unbuffered in attention, layer norm and the bias adds of linear layers, cut in rows or in
    columns; every number the same bits as with NumPy's buffer."""
    cfg = tfmcli.Config(batch=1, seq_len=512, d_model=512, heads=4, d_ff=1536, vocab=64,
                        causal=True, lengths=(500,), seed=2)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    inputs = tfmcli.make_inputs(cfg)
    real, long_rows = parallel.unbuffered, set()

    def spy(row_bytes):
        if row_bytes >= parallel.LONG_ROW:
            long_rows.add(sys._getframe(1).f_code.co_name)     # who asked
        return real(row_bytes)

    monkeypatch.setattr(parallel, "unbuffered", spy)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert long_rows == {"attention_forward_fast", "attention_backward_fast",
                         "layer_norm_forward_fast", "layer_norm_backward_fast", "rows", "columns"}
    monkeypatch.setattr(parallel, "UNBUFFERED", np.getbufsize())   # NumPy's buffer again
    fwd1 = tfmcli.forward(params, inputs, cfg)
    grads1 = tfmcli.backward(params, fwd1, cfg)
    assert fwd.loss == fwd1.loss
    for name in fwd1.acts:
        np.testing.assert_array_equal(fwd.acts[name], fwd1.acts[name], err_msg=name)
    for name in grads1:
        np.testing.assert_array_equal(grads[name], grads1[name], err_msg=name)
    for name in grads1.acts:
        np.testing.assert_array_equal(grads.acts[name], grads1.acts[name], err_msg=name)


def test_a_small_step_runs_in_one_piece_and_a_large_one_in_parts(blas, monkeypatch):
    """``model.threaded``: the fast path hands parts to tfm's threads only from 1,024 rows
    (B T), or from 512 when the largest product comes to 2^29 multiply-adds of float32; a
    smaller step's fast path runs in one piece, its products on BLAS's own threads. Its
    numbers are the threaded path's to rounding (test_fast.py holds both to the reference)."""
    threaded = tfmcli.engine.model.threaded
    cfg = tfmcli.Config(d_model=384, heads=8, vocab=512, d_ff=1536, dtype="float32")
    assert not threaded(cfg, 2, 128) and not threaded(cfg.replace(dtype="float64"), 2, 128)
    assert not threaded(cfg, 2, 256)                 # 512 rows, 302 million multiply-adds
    assert threaded(cfg.replace(dtype="float64"), 2, 256)     # counted twice: 604 million
    assert threaded(cfg.replace(d_model=256, d_ff=1024), 2, 512)   # 1,024 rows
    assert threaded(cfg.replace(d_model=64, d_ff=64, vocab=64), 1, 1024)
    edge = cfg.replace(d_model=512, d_ff=2048)       # 512 rows x 512 x 2048: 2^29 exactly
    assert threaded(edge, 2, 256) and not threaded(edge, 2, 255)
    assert not threaded(edge.replace(d_ff=2047), 2, 256)
    assert not threaded(edge.replace(d_ff=4096), 2, 192)   # 384 rows: too few, whatever the work
    cut = count_cuts(monkeypatch)
    small = tfmcli.Config(batch=2, seq_len=6, d_model=12, heads=3, vocab=11, seed=3)
    params = tfmcli.init_params(small)
    tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(small), small), small)
    assert cut == []
    monkeypatch.setattr(model, "THREADED_ROWS", 1)
    tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(small), small), small)
    assert len(cut) > 10   # attention, layer norm, products: each cut


# ------------------------------------------------------------------ each: items to cores


def test_each_gives_every_items_result_in_order_and_holds_blas_meanwhile(two_cores):
    """Two items at once, one in tfm's thread and one in the caller's (each waits until both
    have begun), their results in the items' order, the progress told as they end, BLAS held
    to one thread until both are done."""
    together = threading.Barrier(2, timeout=10)
    threads, ticks = {}, []

    def call(item):
        threads[item] = threading.current_thread().name
        together.wait()
        assert two_cores.threads == 1
        return item * 10

    assert parallel.each(call, [1, 2], lambda done, total: ticks.append((done, total))) \
        == [10, 20]
    assert len(set(threads.values())) == 2
    assert ticks[-1] == (2, 2) and ticks == sorted(set(ticks)) and two_cores.log == [1, 2]


def test_each_keeps_both_threads_busy_to_the_last_item(two_cores):
    """Eight items of 20 ms on two threads: each thread runs about half of them (the caller
    takes whatever tfm's thread has not begun, never waiting on it while items are left), so
    the whole takes about four items' time, not seven."""
    import time

    threads = []

    def call(item):
        threads.append(threading.current_thread().name)
        time.sleep(0.02)
        return item

    assert parallel.each(call, range(8)) == list(range(8))
    assert min(threads.count(name) for name in set(threads)) >= 3, threads


def test_each_inside_a_task_or_on_one_core_runs_in_the_caller(two_cores):
    caller = threading.current_thread().name
    names = lambda items: parallel.each(lambda _: threading.current_thread().name, items)  # noqa
    two_cores.threads = 1
    assert names(range(3)) == [caller] * 3
    two_cores.threads = 2
    inner = parallel.each(lambda _: set(names(range(3))), range(2))   # nested: one thread each
    assert all(len(made) == 1 for made in inner)


def test_an_error_in_each_is_raised_and_blas_given_back(two_cores):
    def call(item):
        if item == 1:
            raise ValueError("item 1")
        return item

    with pytest.raises(ValueError, match="item 1"):
        parallel.each(call, range(4))
    assert two_cores.threads == 2


def test_after_an_error_in_each_no_item_is_begun(two_cores):
    """The caller runs item 0, which fails while tfm's thread is busy with item 1: items 2
    and 3, begun by no one, are left undone."""
    began, release = [], threading.Event()

    def call(item):
        began.append(item)
        if item == 1:   # done only once the caller has had time to drop what is left
            assert release.wait(10)
            threading.Event().wait(0.2)
        if item == 0:
            while 1 not in began:
                threading.Event().wait(0.001)
            release.set()
            raise ValueError("item 0")
        return item

    with pytest.raises(ValueError, match="item 0"):
        parallel.each(call, range(4))
    assert sorted(began) == [0, 1]
