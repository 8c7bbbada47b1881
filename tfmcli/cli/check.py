"""tfm check --against torch: the same run in an independent PyTorch model, every number
compared."""

from enum import Enum
from typing import Annotated, Optional

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Full, describe, emit, execute, rows_limit
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    choice,
    exact_dtype,
    with_options,
)
from tfmcli.errors import TfmError
from tfmcli.render.numbers import ZERO_TO_PRECISION, negligible
from tfmcli.render.tables import ZERO_NOTE

Against = Enum("Against", {"torch": "torch"}, type=str)


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def check(
    against: Annotated[Against, choice(
        "--against", choices=Against,
        help="The independent implementation to compare with.")] = Against.torch,
    tol: Annotated[Optional[float], typer.Option(
        "--tol",
        help="Largest relative difference that passes (default 1e-9 for float64, 1e-4 for "
             "float32).")] = None,
    full: Full = False,
    opts: Options = None,
):
    """Proof on demand: the run in PyTorch autograd, every number compared; exit 1 if any differs.

    Example: tfm check --against torch --norm post --tokens 3,1,4,1,5
    """
    from tfmcli.check.reference import (
        FLOOR,
        TOLERANCE,
        MissingTorch,
        compare,
        import_torch,
        torch_run,
    )
    from tfmcli.io import run_arrays

    if tol is not None and not tol > 0:
        raise typer.BadParameter(f"{tol} is not allowed (allowed: a positive number)",
                                 param_hint="'--tol'")
    exact = exact_dtype("check", "every number to PyTorch's float64 autograd within 1e-9 "
                                 "(float32: 1e-4)")

    def validate(cfg):   # a rounded --dtype is refused first: no PyTorch would change that
        exact(cfg)
        try:
            import_torch()
        except MissingTorch as e:
            raise typer.BadParameter(str(e), param_hint="'--against'") from None

    run, fwd, grads = execute(opts, with_grads=True, validate=validate)
    cfg = run.cfg
    plan = fwd.caches.get("plan")
    reference = torch_run(run.params, run.inputs, cfg, plan.interventions if plan else ())
    rows = compare(fwd, grads, reference, cfg, tol)
    tolerance = TOLERANCE[cfg.dtype] if tol is None else tol
    failed = [r.name for r in rows if not r.passed]
    # A difference within rounding (exactly 0 on one CPU, 1.7e-16 on another) is written ≈0:
    # its digits are the CPU's, not the model's.
    eps = float(np.finfo(cfg.dtype).eps)
    noise = {r.name for r in rows if r.diff == 0 or negligible(r.diff, r.scale, eps)}
    worst = max((r for r in rows if r.name not in noise), key=lambda r: r.rel, default=None)
    table = render.record_table(
        ["compared", "max relative difference", "check"],
        [[r.name, ZERO_TO_PRECISION if r.name in noise else f"{r.rel:.2e}",
          Text("✓ pass", style="green") if r.passed else Text("✗ FAIL", style="bold red")]
         for r in rows],
        title="tfm against PyTorch autograd (float64)", max_rows=rows_limit(full))
    table.caption = (f"difference = max |tfm - torch| / max |torch|, that at least "
                     f"{FLOOR[cfg.dtype]:g} x the largest gradient (a gradient that is 0 in "
                     f"exact arithmetic holds only noise)"
                     + (f"\n{ZERO_NOTE}" if noise else ""))
    verdict = (Text(f"all {len(rows)} agree to working precision (every difference ≈0)",
                    style="bold green") if worst is None else
               Text(f"all {len(rows)} agree: worst {worst.rel:.2e} ({worst.name}) <= {tolerance:g}",
                    style="bold green") if not failed else
               Text(f"{len(failed)} of {len(rows)} differ beyond {tolerance:g}: "
                    f"{', '.join(failed)}", style="bold red"))
    payload = {"against": against.value, "tolerance": tolerance, "passed": not failed,
               "rows": [{"name": r.name, "rel": r.rel, "passed": r.passed} for r in rows]}
    emit(opts, [render.config_panel(describe(cfg, run), title="tfm check"), table, verdict],
         payload, run_arrays(cfg, run.params, run.inputs, fwd, grads))
    if failed:
        raise TfmError(f"tfm and torch differ beyond {tolerance:g} in {', '.join(failed)}")
