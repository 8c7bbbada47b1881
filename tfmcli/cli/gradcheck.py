"""tfm gradcheck: every parameter's gradient against central differences."""

import math
from typing import Annotated, Optional

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Full, describe, emit, execute, rows_limit
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    exact_dtype,
    with_options,
)
from tfmcli.errors import TfmError


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def gradcheck(
    max_entries: Annotated[Optional[int], typer.Option(
        "--max-entries", callback=bounded(1),
        help="Check at most N sampled entries per tensor (default: all when the model has <= 5,000 "
             "parameters, else 32).")] = None,
    directions: Annotated[Optional[int], typer.Option(
        "--directions", callback=bounded(1, 10_000),
        help="Check each tensor along N random directions, every entry at once "
             "(1..10000).")] = None,
    step: Annotated[float, typer.Option("--step", help="Finite-difference step h.")] = 1e-5,
    full: Full = False,
    tol: Annotated[Optional[float], typer.Option(
        "--tol",
        help="Largest relative error that passes (default 1e-6 for float64, 1e-3 for "
             "float32).")] = None,
    opts: Options = None,
):
    """Check every parameter's gradient against central differences; exit 1 if any fails.

    Example: tfm gradcheck --norm post --activation gelu --lengths 4,2 -L 2
    """
    from tfmcli.cli.checks import default_max_entries, run_gradcheck, verdict
    from tfmcli.io import run_arrays

    for flag, value in (("--step", step), ("--tol", tol)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise typer.BadParameter(f"{value} is not allowed (allowed: a positive number)",
                                     param_hint=f"'{flag}'")
    if directions is not None and max_entries is not None:
        raise typer.BadParameter("--directions checks every entry of a tensor at once; "
                                 "--max-entries samples entries one by one: give one",
                                 param_hint="'--directions'")
    run, fwd, grads = execute(
        opts, with_grads=True, validate=exact_dtype(
            "gradcheck", "each gradient to central differences within 1e-6 (float32: 1e-3)"),
        keep=None if directions is None else lambda run: set(),
        whole="checks entry by entry, each entry's nudge run from its block, so it holds the "
              "whole run; --directions N streams")
    cfg, params, inputs = run.cfg, run.params, run.inputs
    entries = max_entries if max_entries is not None else default_max_entries(cfg)
    plan = fwd.caches.get("plan")
    report = run_gradcheck(params, inputs, cfg, None, entries, step, tol, directions,
                           plan.interventions if plan else (), stream=run.streamed is not None)
    checks = {c.name: c for c in report.params}
    if directions is None:
        rule = (f"numeric gradient: (L(p+h) - L(p-h)) / 2h in float64, h = {report.step:g}\n"
                f"error = max |analytic - numeric| / max(largest |gradient| of the tensor, F)")
    else:
        rule = (f"numeric: (L(p + h v) - L(p - h v)) / 2h in float64, h = {report.step:g}\n"
                f"v: {render.counted(directions, 'random unit direction')} a tensor\n"
                f"error = max |g . v - numeric| / max(|g| / sqrt(n), F), n the tensor's "
                f"entries")
    parts = [render.config_panel(describe(cfg, run), title="tfm gradcheck"),
             render.grad_table(dict(grads), checks, max_rows=rows_limit(full),
                              rope=cfg.pe == "rope"),
             Text(f"{rule}\nF = {report.floor:.6g}: {report.floor_rule}", style="dim"),
             verdict(report, directions)]
    payload = {
        "passed": report.passed,
        "tolerance": report.tolerance,
        "step": report.step,
        "dtype": report.dtype,
        "floor": report.floor,
        "failed": report.failed,
        "checked": report.checked,
        "entries": report.entries,
        "directions": directions,
        "params": [
            {
                "name": c.name,
                "shape": list(c.shape),
                "checked": c.checked,
                "entries": math.prod(c.shape),
                "max_abs_err": c.max_abs_err,
                "rel_err": c.rel_err,
                "passed": c.passed,
            }
            for c in report.params
        ],
    }
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd, grads))
    if not report.passed:
        raise TfmError(f"gradcheck failed for {', '.join(report.failed)}")

