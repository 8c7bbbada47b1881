"""Shared test helpers: running the CLI, reading its one-line errors, random O(1) parameters."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from tfmcli.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def error_line(result, code):
    """The single stderr line of a failed run (and that it is single, with the right code)."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def random_params(params: dict, seed: int = 0) -> dict:
    """Every parameter redrawn at O(1): weights, and gammas, betas and biases too.

    At initial weights every gamma is 1 and every bias 0, and a mistake in those terms of a
    gradient hides; here gammas are drawn in [0.5, 1.5] and everything else from N(0, 0.5).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in params.items():
        if name.endswith("gamma"):
            new = rng.uniform(0.5, 1.5, value.shape)
        else:
            new = rng.normal(0.0, 0.5, value.shape)
        out[name] = new.astype(value.dtype)
    return out
