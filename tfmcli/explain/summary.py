"""A tensor in a few numbers: what the shape trace and ``--json`` report for each activation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 20   # entries per pass of the sum of squares: an 8 MiB float64 buffer, reused


def sum_of_squares(flat, mean: float = 0.0) -> float:
    """sum((x - mean)^2) over the 1-D ``flat``, in float64, a chunk at a time, so that a large
    tensor costs no copy of itself. (BLAS's dot of float32 adds in float32: 1e-4 off on 38
    million entries, GPT-2's embedding gradient.)"""
    buffer = np.empty(min(flat.size, CHUNK))
    total = 0.0
    for start in range(0, flat.size, CHUNK):
        part = buffer[:min(CHUNK, flat.size - start)]
        np.subtract(flat[start:start + CHUNK], mean, out=part, dtype=np.float64)
        total += float(np.dot(part, part))
    return total


@dataclass(frozen=True)
class Summary:
    """What a streamed run keeps of an array it dropped (``model.forward(seen=...)``): its
    shape and dtype, and the numbers the views show of it, made from it as it was dropped.
    ``l2_norm``, ``max_abs``, ``mean`` and ``activation_stats`` answer from it as they would
    from the array; ``finite``: it held no NaN or infinity but where those are allowed
    (``model.first_nonfinite``)."""
    shape: tuple
    dtype: np.dtype
    stats: dict      # activation_stats' (an activation), or {} (a gradient)
    l2: float
    largest: float   # max |x|
    average: float   # the mean
    finite: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, kind: str, name: str, arrays: dict) -> Summary:
        """``arrays[name]`` summarised: ``kind`` "act" (its statistics: the shape trace's) or
        a gradient's, "grad" or "actgrad" (its norm, largest entry and mean: the tables')."""
        from tfmcli.engine.model import first_nonfinite

        value = arrays[name]
        act = kind == "act"
        return cls(tuple(value.shape), value.dtype, activation_stats(name, arrays) if act else {},
                   0.0 if act else l2_norm(value), 0.0 if act else max_abs(value),
                   0.0 if act else mean(value), first_nonfinite({name: value}) is None)


def l2_norm(array) -> float:
    """sqrt of the sum of squares, accumulated in float64 without a float64 copy."""
    if isinstance(array, Summary):
        return array.l2
    flat = np.asarray(array).reshape(-1)
    if flat.dtype == np.float64:   # BLAS's dot adds float64 in float64: one pass, no buffer
        return float(np.sqrt(np.dot(flat, flat)))
    return float(np.sqrt(sum_of_squares(flat)))


def max_abs(array) -> float:
    """max |x| from the max and the min: no array of absolute values (GPT-2's embedding
    gradient is 300 MB). NaN if there is one; 0.0 for an empty array."""
    if isinstance(array, Summary):
        return array.largest
    flat = np.asarray(array).reshape(-1)
    return abs(float(max(flat.max(), -flat.min()))) if flat.size else 0.0


def mean(array) -> float:
    """The mean, summed in float64 (a float32 sum of millions of entries is off in the fourth
    digit); 0.0 for an empty array."""
    if isinstance(array, Summary):
        return array.average
    flat = np.asarray(array).reshape(-1)
    return float(flat.mean(dtype=np.float64)) if flat.size else 0.0


def stats(array: np.ndarray) -> dict:
    """Shape; min / mean / std / max over the finite entries (None if there are none); and,
    when present, how many entries are -inf (``masked``: a hidden attention score), +inf
    (``inf``) or NaN (``nan``)."""
    array = np.asarray(array)
    out = {"shape": list(array.shape)}
    flat = array.reshape(-1)
    n, counts, chunks = flat.size, {}, _whole
    if n:
        low, high = flat.min(), flat.max()   # a NaN or an infinity shows in one of these
        if array.dtype.kind == "f" and not (np.isfinite(low) and np.isfinite(high)):
            chunks = _finite_chunks
            n, total, finite_low, finite_high = _count_sum_extremes(chunks(flat))
            counts = _nonfinite_counts(flat, low, high, flat.size - n)
            low, high = finite_low, finite_high
        else:
            total = float(np.sum(flat, dtype=np.float64))
    if n:   # accumulated in float64
        mean = total / n
        squares = sum(sum_of_squares(part, mean) for part in chunks(flat))
        out.update(min=float(low), mean=mean, std=float(np.sqrt(squares / n)), max=float(high))
    else:
        out.update(min=None, mean=None, std=None, max=None)
    out.update((key, count) for key, count in counts.items() if count)
    return out


def activation_stats(name: str, acts) -> dict:
    """``stats`` of the activation ``name`` of a forward pass, one rule for what is hidden: an
    attention pattern's hidden cells (0 where the scores are -inf) are left out and counted
    (``hidden``), as the scores' -inf are."""
    value = acts[name]
    if isinstance(value, Summary):
        return value.stats
    scores = name.removesuffix("pattern") + "scores"
    if name.endswith("attn.pattern") and scores in acts:
        visible = np.isfinite(acts[scores])
        hidden = int(visible.size - np.count_nonzero(visible))
        if hidden:
            out = stats(value[visible])
            out.update(shape=list(value.shape), hidden=hidden)
            return out
    return stats(value)


def _whole(flat):
    """``flat`` as the one chunk of its entries (every one finite)."""
    return (flat,)


def _finite_chunks(flat):
    """The finite entries of the 1-D ``flat``, a chunk at a time. Plain reductions over them
    are much quicker than ``where=`` reductions over the whole: a masked (12, 1024, 1024)
    float64 score array's statistics took 47 ms instead of 63, each chunk made twice (for the
    sum, then for the squares about the mean). Kept between the two they took longer: their
    memory was fresh, where a chunk made again reuses the last one's."""
    for start in range(0, flat.size, CHUNK):
        chunk = flat[start:start + CHUNK]
        yield chunk[np.isfinite(chunk)]


def _count_sum_extremes(parts) -> tuple:
    """(count, float64 sum, min, max) over the arrays ``parts`` (min and max None if empty)."""
    n, total, low, high = 0, 0.0, None, None
    for part in parts:
        if part.size:
            n += part.size
            total += float(np.sum(part, dtype=np.float64))
            low = part.min() if low is None else min(low, part.min())
            high = part.max() if high is None else max(high, part.max())
    return n, total, low, high


def _nonfinite_counts(flat, low, high, nonfinite: int) -> dict:
    """How many entries are -inf, +inf and NaN, given the array's plain min and max and the
    number of entries that are not finite. min and max pass a NaN on, and a max below +inf
    means none is +inf: the usual case (masked scores: only -inf) needs no further pass."""
    if np.isnan(low):
        return {"masked": int(np.isneginf(flat).sum()), "inf": int(np.isposinf(flat).sum()),
                "nan": int(np.isnan(flat).sum())}
    inf = int(np.isposinf(flat).sum()) if high == np.inf else 0
    return {"masked": nonfinite - inf, "inf": inf, "nan": 0}
