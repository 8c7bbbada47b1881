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
        return np.asarray(x).astype(self.store).astype(self.array)

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


# float32's and float64's layouts: (unsigned view, mantissa bits, sign bit)
LAYOUTS = {np.dtype(np.float32): (np.uint32, 23, 1 << 31),
           np.dtype(np.float64): (np.uint64, 52, 1 << 63)}


def round_float16(x) -> np.ndarray:
    """``x`` rounded to the nearest float16 values (ties to even), held in float32: what
    ``x.astype(np.float16).astype(np.float32)`` gives, bit for bit (NaN stays NaN, past 65504
    inf), made from the bits. NumPy's own cast of a value in float16's subnormal range (below
    2^-14, as most of a gradient can be) takes 25 times as long as of a normal one: a
    GPT-2-small step in float16 took 38 times its float32 time, with this 2.5."""
    x = np.asarray(x)
    if x.dtype not in LAYOUTS:
        return x.astype(np.float16).astype(np.float32)
    unsigned, mantissa, sign_bit = LAYOUTS[x.dtype]
    drop = mantissa - 10                       # float16 keeps 10 mantissa bits
    bits = np.ascontiguousarray(x).view(unsigned)
    magnitude = bits & unsigned(sign_bit - 1)
    # ties to even: add half a step less one, and the kept part's lowest bit
    lowest = (magnitude >> unsigned(drop)) & unsigned(1)
    kept = (magnitude + unsigned((1 << (drop - 1)) - 1) + lowest) & ~unsigned((1 << drop) - 1)
    size = magnitude.view(x.dtype)
    with np.errstate(all="ignore"):
        out = np.where(kept.view(x.dtype) > 65504.0, np.inf, kept.view(x.dtype))
        small = (size < 2.0 ** -14) & (size > 0)   # float16's subnormals: multiples of 2^-24
        if small.any():
            out[small] = np.round(size[small] * 2.0 ** 24) * 2.0 ** -24
        out = np.where(np.isnan(size), size, out).astype(x.dtype, copy=False)
        signed = (out.view(unsigned) | (bits & unsigned(sign_bit))).view(x.dtype)
        rounded = signed.astype(np.float32, copy=False)
    if np.isinf(out).any() and (np.isinf(out) & np.isfinite(size)).any():
        # a finite value past float16's range: the overflow NumPy's own cast reports, under
        # the caller's np.errstate (raised, warned or ignored)
        np.array([65520.0], np.float32).astype(np.float16)
    return rounded


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
    a mapping whose ``rounded`` names this policy (its values are the dtype's already):
    ``params`` itself."""
    if policy.exact or getattr(params, "rounded", None) == policy.name:
        return params   # (a mapping that rounds as it reads already: tfm precision's)
    return Stored(params, policy)


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
