"""Seeded initialisation. One generator, created by the caller, draws every weight in order."""

from __future__ import annotations

import numpy as np

from tfmcli.engine import precision
from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes


def draw_weight(rng, scheme, shape):
    """A weight matrix of ``shape`` = (fan_in, fan_out) under ``scheme``, in float64."""
    fan_in, fan_out = shape
    if scheme == "normal":
        return rng.normal(0.0, 0.02, shape)
    if scheme == "uniform":
        return rng.random(shape)
    if scheme == "xavier":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape)
    if scheme == "kaiming":
        return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    raise ValueError(f"unknown init scheme {scheme!r}")


def init_params(cfg: Config) -> dict[str, np.ndarray]:
    """Every parameter of the model, by name.

    Weights (every 2-D parameter, the embedding included) are drawn in the order of
    ``sizes.param_shapes`` from ``np.random.default_rng(cfg.seed)``; biases and betas are 0,
    gammas are 1. Every array has ``cfg.np_dtype``; in float16 and bfloat16 each value is
    the float64 draw rounded to the dtype (``engine.precision``), as ``model.to(dtype)`` rounds.
    """
    rng = np.random.default_rng(cfg.seed)
    policy = precision.of(cfg.dtype)
    params = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[1]
        if len(shape) == 2:
            value = draw_weight(rng, cfg.init, shape)
        elif leaf == "gamma":
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        # no second copy in float64; rounded straight from float64 in float16 and bfloat16
        params[name] = policy.round(value).astype(cfg.np_dtype, copy=False)
    return params
