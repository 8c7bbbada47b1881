"""A tensor in a few numbers: what the shape trace and ``--json`` report for each activation."""

from __future__ import annotations

import numpy as np


def stats(array: np.ndarray) -> dict:
    """Shape; min / mean / std / max over the finite entries (None if there are none); and,
    when present, how many entries are -inf (``masked``: a hidden attention score), +inf
    (``inf``) or NaN (``nan``)."""
    array = np.asarray(array)
    floating = array.dtype.kind == "f"
    finite = array[np.isfinite(array)] if floating else array.reshape(-1)
    out = {"shape": list(array.shape)}
    if finite.size:
        finite = finite.astype(np.float64)
        out.update(min=float(finite.min()), mean=float(finite.mean()),
                   std=float(finite.std()), max=float(finite.max()))
    else:
        out.update(min=None, mean=None, std=None, max=None)
    if floating:
        for key, count in (("masked", np.isneginf(array).sum()), ("inf", np.isposinf(array).sum()),
                           ("nan", np.isnan(array).sum())):
            if count:
                out[key] = int(count)
    return out
