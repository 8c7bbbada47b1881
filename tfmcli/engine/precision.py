"""A dtype as a policy: what each tensor is stored as, and what each operation computes in.

float64 and float32 are exact: the engine's arrays are of that dtype and nothing is rounded
(their paths are the ones they always were, bit for bit). float16 and bfloat16 emulate
PyTorch eager on the CPU in that dtype: every tensor holds values of the dtype, and each
operation computes in float32 (matrix products, softmax, norms and the loss accumulate in
float32) and rounds its result to the dtype once. Such a tensor is held in a float32 array
whose every value is one of the dtype's: NumPy's BLAS multiplies float32, NumPy has no
bfloat16 (``ml_dtypes`` has, but NumPy sums its arrays in bfloat16 itself, and no view of tfm
reads one), and a float32 array is what every view already reads.

The rule is written once, here, and applied where the pass stores a tensor:

- ``op`` marks each function of ``ops`` that is one operation (one PyTorch kernel: a matrix
  product with its bias, a softmax, a norm, an activation, the loss, a backward of one of
  them) and rounds its results, not its cache (a kernel's backward recomputes its float32
  intermediates from the stored inputs);
- ``Tape.keep`` and ``keep_grad`` round each activation and gradient as the pass keeps it, so
  that the block's own sums (``x + MHA(LN1(x))``) round as torch's add does;
- the operations that are several kernels in torch (attention's product, scale, softmax and
  product; RoPE's two products and their sum; the soft cap) round between their steps
  through ``rounding()``.

A pass applies the policy of its Config (``using``); outside one, every ``op`` is exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

ROUNDED = ("float16", "bfloat16")   # the dtypes held in float32 arrays, rounded at each op
CARRIER = np.dtype(np.float32)      # what holds them, and what their operations compute in


class Precision(NamedTuple):
    """One dtype's policy.

    Attributes
    ----------
    name : str
        "float64", "float32", "float16" or "bfloat16".
    array : np.dtype
        The engine's arrays' dtype (float32 for the rounded dtypes).
    exact : bool
        Nothing is rounded: the arrays' dtype is the dtype.
    """

    name: str
    array: np.dtype
    exact: bool

    @property
    def store(self) -> np.dtype:
        """The dtype itself (``ml_dtypes.bfloat16`` for bfloat16, imported on first use)."""
        if self.name == "bfloat16":
            import ml_dtypes  # here: 5 ms, and only a bfloat16 run pays them

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.name)

    @property
    def finfo(self):
        """The dtype's limits (``eps``, ``tiny``: the smallest normal, ``max``)."""
        if self.name == "bfloat16":
            import ml_dtypes

            return ml_dtypes.finfo(self.store)
        return np.finfo(self.store)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next value (2^-7 for bfloat16, 2^-10
        for float16, 2^-23 for float32); one rounding errs by at most half of it."""
        return float(self.finfo.eps)

    def round(self, x):
        """``x`` with each value rounded to the nearest of the dtype (ties to even), held in
        the engine's arrays' dtype; exact: ``x`` itself. A float (the loss) comes back a
        float. Past the dtype's range a value becomes inf (float16's 65504), as torch's cast
        makes it."""
        if self.exact:
            return x
        if isinstance(x, float):
            return float(np.asarray(x, dtype=self.store))
        if self.name == "float16":
            return round_float16(x)
        return round_bfloat16(x)

    def kept(self, x):
        """``x`` as the pass stores it: ``x`` itself when every value is already one of the
        dtype's (an operation's rounded result: no second copy beside the one its cache
        holds), else ``round(x)`` (a sum the block made)."""
        if self.exact:
            return x
        rounded = self.round(x)
        return x if np.array_equal(rounded, x, equal_nan=True) else rounded

    def round_results(self, out, results: int | None):
        """An operation's return value with its results rounded: every array of a tuple
        (``results`` None), or its first ``results`` items (the rest is the cache)."""
        if not isinstance(out, tuple):
            return self._rounded(out)
        count = len(out) if results is None else results
        head = tuple(self._rounded(item) for item in out[:count])
        return type(out)(*head, *out[count:]) if hasattr(out, "_fields") else head + out[count:]

    def _rounded(self, x):
        if isinstance(x, np.ndarray) or isinstance(x, float):
            return self.round(x)
        return x   # None (no bias, no gradient), an int


class Layout(NamedTuple):
    """A float's bits: its unsigned view, mantissa bits, exponent field's mask and bias."""

    unsigned: type
    mantissa: int
    exponent: int
    bias: int


LAYOUTS = {np.dtype(np.float32): Layout(np.uint32, 23, 0x7F800000, 127),
           np.dtype(np.float64): Layout(np.uint64, 52, 0x7FF0000000000000, 1023)}
CHUNK = 1 << 15   # entries a large tensor is rounded in at once: its scratch stays in cache
SHORT = 4096      # entries: a tensor shorter than this is rounded by NumPy's cast in one call


def round_float16(x) -> np.ndarray:
    """``x`` rounded to the nearest float16 values (ties to even), held in float32: what
    ``x.astype(np.float16).astype(np.float32)`` gives, bit for bit (NaN stays NaN, past 65504
    inf, an overflow of a finite value reported as the cast reports it, under the caller's
    ``np.errstate``), made by float arithmetic a chunk at a time (``_float16_chunk``). Two
    differences from the cast, neither seen by a pass: a NaN keeps its payload (the cast
    makes it quiet and cuts it), and an underflow to 0 is not reported. NumPy's own cast of
    a value in float16's subnormal range (below 2^-14, as most of a gradient can be) takes
    25 times as long as of a normal one: a GPT-2-small step in float16 took 38 times its
    float32 time with it; a gradient of 38.6M entries is rounded in 1.6 s by the cast, in
    52-72 ms so, on one core."""
    x = np.asarray(x)
    if x.dtype not in LAYOUTS or x.size < SHORT:
        return x.astype(np.float16).astype(np.float32)
    unsigned = LAYOUTS[x.dtype].unsigned
    overflowed = []

    def scratch(n):   # magnitudes (float64's: float32's are made in the output), bits, a mask
        return (np.empty(n if x.dtype != CARRIER else 0, x.dtype), np.empty(n, unsigned),
                np.empty(n, bool))

    def chunk(source, out, arrays):
        overflowed.append(_float16_chunk(source, out, arrays))

    out = _chunked(x, chunk, scratch, passes=8)
    if any(overflowed):
        # a finite value past float16's range: the overflow NumPy's own cast reports, under
        # the caller's np.errstate (raised, warned or ignored)
        np.array([65520.0], np.float32).astype(np.float16)
    return out


def _float16_chunk(source, out, scratch) -> bool:
    """``out`` (float32) = ``source`` (float32 or float64) rounded to float16's values, in
    ``source``'s own arithmetic; whether a finite value overflowed. ``scratch``: (magnitudes
    in ``source``'s dtype, their bits, a mask), each at least ``source``'s length but the
    magnitudes of a float32 source, made in ``out``.

    A magnitude m whose exponent is e is rounded to float16's 11 significant bits by (m + c)
    - c, with c = 2^(e + mantissa - 10) (mantissa: ``source``'s bits): the sum's last bit is
    m's bit of weight 2^(e - 10), so the addition rounds m to a multiple of that, ties to
    even, as the cast does, and the subtraction is exact. Below 2^-14 float16's values are
    the multiples of 2^-24, which c's floor, 2^(mantissa - 24), makes the step. A chunk with a
    magnitude of 2^15 or more, inf or NaN may overflow: its magnitudes are first held to
    2^17, whose rounding is past 65504 as theirs is (and keeps c finite; NaN passes through),
    and past 65504 made inf."""
    unsigned, mantissa, exponent, bias = LAYOUTS[source.dtype]
    n = source.size
    m = out if source.dtype == out.dtype else scratch[0][:n]
    c, over = scratch[1][:n], scratch[2][:n]
    np.abs(source, out=m)
    np.bitwise_and(m.view(unsigned), unsigned(exponent), out=c)
    wide = c.max() >= unsigned((bias + 15) << mantissa)
    if wide:
        np.minimum(m, 2.0 ** 17, out=m)
        np.bitwise_and(m.view(unsigned), unsigned(exponent), out=c)
    np.maximum(c, unsigned((bias - 14) << mantissa), out=c)
    c += unsigned((mantissa - 10) << mantissa)
    real = c.view(source.dtype)
    m += real
    m -= real
    overflowed = False
    if wide:
        np.greater(m, 65504.0, out=over)
        if over.any():
            overflowed = bool(np.isfinite(source[over]).any())
            m[over] = np.inf
    np.copysign(m, source, out=m)
    if m is not out:
        out[...] = m   # exact: every value is float16's
    return overflowed


def round_bfloat16(x) -> np.ndarray:
    """``x`` rounded to bfloat16 by ml_dtypes's cast, held in float32: a large tensor a chunk
    at a time, so that only a chunk of bfloat16 is held beside the result."""
    x = np.asarray(x)
    store = of("bfloat16").store
    if x.size < SHORT:
        return x.astype(store).astype(CARRIER)

    def chunk(source, out, held):
        held = held[:source.size]
        held[...] = source
        out[...] = held

    return _chunked(x, chunk, lambda n: np.empty(n, store), passes=2)


def _chunked(x, chunk, scratch, passes: int) -> np.ndarray:
    """A float32 array of ``x``'s shape, made ``CHUNK`` entries at a time by ``chunk(source,
    out, arrays)`` (``arrays = scratch(n)``, made once per thread for chunks of at most n
    entries), the chunks shared among the cores (``parallel.run``; ``passes``: about how many
    element-wise passes over a chunk that takes). Every entry is rounded on its own, so parts
    change no bit. Inside a rounded pass (one piece) the chunks are the caller's alone: on
    GPT-2 small's float16 step (32 tokens), rounding on two threads beside BLAS's spinning
    ones took 1,324 ms where one took 1,023."""
    from tfmcli.engine import parallel

    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(np.shape(x), CARRIER)
    made = out.reshape(-1)

    def part(entries):
        arrays = scratch(min(CHUNK, len(range(entries.start, entries.stop))))
        for start in range(entries.start, entries.stop, CHUNK):
            stop = min(start + CHUNK, entries.stop)
            chunk(flat[start:stop], made[start:stop], arrays)

    parallel.run(part, flat.size, parallel.cost(flat.size * passes * parallel.PASS,
                                                 flat.dtype), CHUNK)
    return out


@functools.lru_cache(maxsize=None)
def of(dtype: str) -> Precision:
    """The policy of a Config's ``dtype``."""
    if dtype in ROUNDED:
        return Precision(dtype, CARRIER, False)
    return Precision(dtype, np.dtype(dtype), True)


EXACT = of("float64")
_active: contextvars.ContextVar[Precision] = contextvars.ContextVar("tfm_precision",
                                                                    default=EXACT)


def active() -> Precision:
    """The policy of the pass running here (exact outside one)."""
    return _active.get()


def rounding():
    """The running pass's rounding, for an operation that is several kernels in torch: its
    policy's ``round`` (the identity when exact: the same array back, no copy)."""
    return _active.get().round


@contextlib.contextmanager
def using(policy: Precision):
    """Every ``op`` inside rounds as ``policy`` says (a pass enters it: ``model._engine``). A
    thread started inside does not see it: a rounded pass runs in one piece."""
    token = _active.set(policy)
    try:
        yield
    finally:
        _active.reset(token)


def op(fn=None, *, results: int | None = None):
    """Mark ``fn`` as one operation: in a rounded pass its results are rounded to the dtype
    (``Precision.round_results``: ``results`` leading items of its tuple, or all). Exact, it
    is ``fn`` as it was, one look-up later."""
    def mark(fn):
        @functools.wraps(fn)
        def operation(*args, **kwargs):
            out = fn(*args, **kwargs)
            policy = _active.get()
            return out if policy.exact else policy.round_results(out, results)

        operation.results = results
        return operation

    return mark if fn is None else mark(fn)


def stored(params, policy: Precision):
    """``params`` as a rounded pass reads them: each value rounded to the dtype when read (a
    mapping over the same arrays; a checkpoint's bfloat16 weights come back equal). Exact, or
    a mapping whose ``rounded`` names this policy (its values are the dtype's already: a
    ``Cast``, ``tfm precision``'s weights): ``params`` itself."""
    if policy.exact or getattr(params, "rounded", None) == policy.name:
        return params
    return Stored(params, policy)


class Cast(dict):
    """Parameters as a model cast to a rounded dtype holds them (torch's ``model.to(dtype)``):
    each value rounded once, as it is put in (an overflow reported under the caller's
    ``np.errstate``, with the parameter's name), and read-only, so that it stays the dtype's.
    A pass in that dtype reads them as they are (``stored``), where it rounds a plain dict's
    values at every read: GPT-2 small's step on 32 tokens took 1.88-1.94 times float32's in
    bfloat16 and 2.95-3.02 in float16 (docs/performance.md), with both the rounding's and
    this change. A run in a rounded dtype holds its weights so (``Run.complete``): change one
    by assigning it (rounded again), or edit a copy (``{n: v.copy() for n, v in
    cast.items()}``). A copy (``dict(cast)``, ``.copy()``, ``copy.copy``) is a plain dict of
    the same arrays.

    Attributes
    ----------
    policy : Precision
        The dtype's policy (never an exact one).
    rounded : str
        The dtype's name.
    """

    def __init__(self, params, policy: Precision):
        if policy.exact:
            raise ValueError(f"{policy.name} rounds nothing: a Cast holds a rounded dtype's "
                             f"values (float16, bfloat16)")
        super().__init__()
        self.policy, self.rounded = policy, policy.name
        self.update(params)

    def __setitem__(self, name, value):
        try:
            value = self.policy.round(np.asarray(value))   # a new array of the dtype's values
        except FloatingPointError as e:
            raise FloatingPointError(f"{e} of {name}") from None
        value.flags.writeable = False
        super().__setitem__(name, value)

    def update(self, *args, **kwargs):
        for name, value in dict(*args, **kwargs).items():
            self[name] = value

    def setdefault(self, name, default=None):
        if name not in self:
            self[name] = default
        return self[name]

    def __ior__(self, other):
        self.update(other)
        return self

    def copy(self) -> dict:
        return dict(self)

    def __reduce__(self):
        return dict, (dict(self),)


class Stored(Mapping):
    """A mapping of parameters read through a policy's rounding (``stored``). It holds no
    copy: a streamed run's weights stay in their files until read, and each read rounds
    again (a weight is read once in the forward, once in the backward)."""

    def __init__(self, params, policy: Precision):
        self.params, self.policy = params, policy

    def __getitem__(self, name):
        return self.policy.round(self.params[name])

    def __contains__(self, name):
        return name in self.params

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)
