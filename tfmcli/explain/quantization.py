"""What quantization did to each weight: the quantized model's tensors against the original's
(a GGUF file against its checkpoint folder, or against a less quantized file of the same
model), tensor by tensor, as the quantization lens shows them (issue 73). Weights only: the
runs' activations are ``explain.precision``'s to compare.

Relative errors, so that tensors of any scale read alike: the RMS of the difference over the
original's RMS, and the largest difference over the original's largest magnitude (Q8_0 keeps
each entry within half a step of its block, max|w| / 254, so its relative max is at most about
1/254 = 0.0039 where the block holds the tensor's largest weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tfmcli.errors import TfmError


@dataclass(frozen=True)
class WeightError:
    """One weight tensor's quantization error.

    ``rel_rms``: RMS(q - w) / RMS(w); ``rel_max``: max|q - w| / max|w| (0 when both are all 0,
    inf when only the original is); ``max_abs``: max|q - w|; ``kind``: the quantized tensor's
    stored type ("Q8_0", "F32"), when known.
    """

    name: str
    shape: tuple[int, ...]
    kind: str | None
    rel_rms: float
    rel_max: float
    max_abs: float

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "stored": self.kind,
                "rel_rms": self.rel_rms, "rel_max": self.rel_max, "max_abs": self.max_abs}


def weight_error(name: str, quantized: np.ndarray, original: np.ndarray,
                 kind: str | None = None) -> WeightError:
    """``quantized`` against ``original`` (the same shape), in float64."""
    q, w = np.asarray(quantized, np.float64), np.asarray(original, np.float64)
    if q.shape != w.shape:
        raise TfmError(f"{name}: the quantized tensor has shape {q.shape}, the original "
                       f"{w.shape}; they are not the same model's")
    diff = q - w
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    rms = float(np.sqrt(np.mean(diff ** 2))) if diff.size else 0.0
    scale_rms = float(np.sqrt(np.mean(w ** 2))) if w.size else 0.0
    scale_max = float(np.abs(w).max()) if w.size else 0.0
    return WeightError(name, w.shape, kind, _ratio(rms, scale_rms), _ratio(max_abs, scale_max),
                       max_abs)


def _ratio(error: float, scale: float) -> float:
    if scale > 0:
        return error / scale
    return 0.0 if error == 0 else float("inf")


def weight_errors(quantized: Mapping, original: Mapping,
                  kinds: Mapping | None = None) -> list[WeightError]:
    """Every tensor of ``original`` (name -> array, tfm's names, in its order) against the
    ``quantized`` model's (the same names), each read once and let go: a lazily read model
    (``sources``' ``lazy_params``) is held a tensor at a time. ``kinds``: name -> stored type.
    TfmError naming the first tensor one of them lacks."""
    missing = next((name for name in original if name not in quantized), None) or \
        next((name for name in quantized if name not in original), None)
    if missing is not None:
        which = "quantized" if missing in original else "original"
        raise TfmError(f"{missing}: the {which} model has no such tensor; they are not the same "
                       f"model's")
    kinds = kinds or {}
    return [weight_error(name, quantized[name], original[name], kinds.get(name))
            for name in original]


def weights_error(errors: list[WeightError]) -> float:
    """The model's weights' error in one number: the RMS of the tensors' relative RMS errors,
    each counted as many times as it has entries (what a weight entry typically carries: the
    lens's unit when it runs in float64, as a dtype's eps is a rounded run's). A tensor
    stored exactly (a norm's gain kept in F32) counts at 0."""
    sizes = np.array([np.prod(e.shape) for e in errors], dtype=np.float64)
    squares = np.array([e.rel_rms ** 2 for e in errors])
    finite = np.isfinite(squares)
    total = float(np.sqrt((sizes[finite] * squares[finite]).sum() / sizes[finite].sum())) \
        if finite.any() else 0.0
    if total == 0:
        raise TfmError("the quantized model's weights are the original's exactly: there is "
                       "no quantization to see (give --dtype to hold a rounded run against it)")
    return total
