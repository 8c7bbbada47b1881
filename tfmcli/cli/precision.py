"""tfm precision: the run in float32, float16 or bfloat16 held against float64, tensor by tensor."""

import json
from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Full, Row, check_indices, describe, emit, rows_limit, width
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    DType,
    Options,
    check_memory,
    with_options,
)
from tfmcli.errors import TfmError

KL_SHOWN = 16   # positions of --row whose KL divergence the view lists (--json: every one)


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, OUTPUT_OPTIONS)
def precision(
    threshold: Annotated[float, typer.Option(
        "--threshold", min=0.0, help="Name the first tensor past this many eps.")] = 4.0,
    row: Row = 0,
    full: Full = False,
    opts: Options = None,
):
    """The run in bfloat16 (or --dtype) against float64: every tensor's error, own and inherited.

    Example: tfm precision --arch llama -L 4 --dtype float16
    """
    from tfmcli.engine.memory import keep_freed_memory
    from tfmcli.explain.precision import held_against_float64
    from tfmcli.io import run_arrays

    dtype = opts.values["dtype"].value if opts.explicit("dtype") else "bfloat16"
    if dtype == "float64":
        raise typer.BadParameter("float64 is the truth tfm precision holds the run against; "
                                 "give the dtype to measure: float32, float16 or bfloat16",
                                 param_hint="'--dtype'")
    if opts.values.get("stream"):
        raise typer.BadParameter("tfm precision compares every tensor of three whole runs "
                                 "(float64's, the dtype's, and its own operations'), so it "
                                 "holds them all; run it without --stream",
                                 param_hint="'--stream'")
    opts.values["dtype"] = DType.float64   # the weights read in float64 (an .npz: in its own)
    keep_freed_memory()
    run = opts.run(untyped={"dtype"})
    cfg = run.cfg.replace(dtype="float64")
    check_indices(cfg, row)
    if not opts.values.get("force"):   # float64's run, and two in the dtype (float32 arrays)
        from tfmcli.engine.sizes import memory_estimate

        check_memory(cfg, extra=2 * memory_estimate(cfg.replace(dtype=dtype))["total"],
                     what=f"a float64 run and two in {dtype}", opts=opts)
    params = {name: np.asarray(value, dtype=np.float64)
              for name, value in run.complete().params.items()}
    truth, truth_grads = float64_run(params, run.inputs, cfg)
    report = held_against_float64(params, run.inputs, cfg, dtype, threshold, truth, truth_grads)
    panel = describe(cfg, run, row)
    panel["dtype"] = f"{dtype}, held against float64"
    eps = report.eps
    parts = [render.config_panel(panel, title="tfm precision"),
             Text(f"RMS, max: |{dtype} - float64| over the tensor's float64 RMS\n"
                  f"eps: the RMS in {dtype}'s eps, {eps:.2g} (2^{int(np.log2(eps))}); "
                  f"◀ past {threshold:g}\n"
                  f"own: the operation on float64's inputs rounded to {dtype} (in eps)\n"
                  f"inh.: inherited, what its inputs' error adds (in eps)\n"
                  f"inf NaN →0: entries made inf, NaN, 0 or subnormal where float64's are not",
                  style="dim")]
    for title, errors, prefix in (("activations, forward", report.activations, ""),
                                  ("their gradients, backward", report.gradients, ""),
                                  ("the parameters' gradients", report.parameters, "grad ")):
        parts.append(error_table(title, errors, report.threshold, rows_limit(full), prefix))
    parts += summary(report, cfg, run, row)
    payload = {"config": json.loads(cfg.replace(dtype=dtype).to_json()), **report.to_dict(),
               "row": row}
    emit(opts, parts, payload, run_arrays(cfg, params, run.inputs, truth, truth_grads))


def float64_run(params, inputs, cfg):
    """The truth: the run in float64, refused if it overflows (then nothing it says is
    right)."""
    import tfmcli
    from tfmcli.engine.model import first_nonfinite

    try:
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            truth = tfmcli.forward(params, inputs, cfg)
            grads = tfmcli.backward(params, truth, cfg)
    except FloatingPointError as e:
        raise TfmError(f"the float64 run overflowed ({e}): no truth to hold the run against; "
                       f"use smaller weights or inputs") from None
    bad = first_nonfinite(truth.acts) or first_nonfinite(grads) or first_nonfinite(grads.acts)
    if bad:
        raise TfmError(f"the float64 run produced NaN or Inf (first in {bad}): no truth to "
                       f"hold the run against")
    return truth, grads


def _error(x: float) -> str:
    return "inf" if x == np.inf else "NaN" if np.isnan(x) else f"{x:.1e}"


def _eps(x: float) -> str:
    """An error in eps: 0 exactly, <0.1, one decimal, or whole past 100."""
    if not np.isfinite(x):
        return _error(x)
    return "0" if x == 0 else "<0.1" if x < 0.05 else f"{x:.1f}" if x < 99.95 else f"{x:.0f}"


def error_table(title: str, errors, threshold: float, max_rows, prefix: str = ""):
    """One row per tensor: its error, in eps, split into own and inherited, and what
    overflowed, made NaN or went to 0; ◀ where it is past the threshold. ``prefix``: what
    the names begin with, left out ("grad ")."""
    rows = []
    for e in errors:
        counts = " ".join(f"{n} {what}" for n, what in ((e.inf, "inf"), (e.nan, "NaN"),
                                                         (e.flushed, "→0")) if n)
        mark = " ◀" if e.crosses(threshold) else ""
        rows.append([e.name.removeprefix(prefix) + ("*" if e.zero else ""), _error(e.rms),
                     _error(e.max), _eps(e.in_eps) + mark, _eps(e.own / e.eps),
                     _eps(e.inherited / e.eps), counts or "·"])
    table = render.record_table(["tensor", "RMS", "max", "eps", "own", "inh.", "inf NaN →0"],
                                rows, title=title, max_rows=max_rows)
    if any(e.zero for e in errors):
        table.caption = "* 0 in exact arithmetic: its error against the largest gradient's RMS"
    return table


def summary(report, cfg, run, row: int) -> list:
    """The first tensors past the threshold, the residual stream's error block by block, the
    next tokens where the two runs' differ, their KL divergence, and the loss in both."""
    from tfmcli.explain.precision import NEAR_TIE

    dtype, parts = report.dtype, []
    first, first_grad = report.first(report.activations), report.first(report.gradients)
    said = [f"{e.name} ({_eps(e.in_eps)} eps: own {_eps(e.own / e.eps)}, inherited "
            f"{_eps(e.inherited / e.eps)})" if e else "none" for e in (first, first_grad)]
    parts.append(Text(f"first past {report.threshold:g} eps: {said[0]}\n"
                      f"in the backward: {said[1]}", style="bold"))
    if cfg.layers > 1:   # each block's input a few columns wide, then the last one's output
        errors = [e.in_eps for _, e in report.stream(cfg.layers)]
        wide = max(1, min(4, (width() - 12) // len(errors)))
        ys = np.nan_to_num(np.repeat(errors, wide), nan=0.0, posinf=0.0)
        parts.append(render.curve(["block 0"] + [""] * (len(ys) - 2) + ["out"], ys,
                                  title="the residual stream's error, in eps: each block's "
                                        "input, then the last one's output",
                                  width=width(), height=5))
    flips = report.flips
    if flips:
        rows = [[f"{p.row}, {p.position}",
                 run.token_text(int(run.inputs.tokens[p.row, p.position])),
                 run.token_text(p.truth), run.token_text(p.low), f"{p.gap:.1f}",
                 f"{p.noise:.1f}", "near tie" if p.near_tie else ""] for p in flips]
        table = render.record_table(
            ["row, position", "token", "float64 next", f"{dtype} next", "gap", "error", ""],
            rows, title=f"the most likely next token flips at {len(flips)} of "
                        f"{len(report.positions)} positions", left=4)
        table.caption = (f"gap: float64's top two logits apart, in {dtype}'s eps of their "
                         f"size; error: this run's in a difference of two logits there "
                         f"(RMS, same eps); a near tie: gap under {NEAR_TIE:g} x error, "
                         f"which another rounding order may flip or not")
        parts.append(table)
    else:
        parts.append(Text(f"the most likely next token: the same in both at all "
                          f"{len(report.positions)} positions"))
    kl = np.array([p.kl for p in report.positions])
    worst = report.positions[int(np.nanargmax(kl))] if np.isfinite(kl).any() else None
    said = (f"mean {np.mean(kl):.1e}, largest {worst.kl:.1e} (row {worst.row}, position "
            f"{worst.position})" if worst else f"{np.mean(kl):.1e}")
    mine = [p.kl for p in report.positions if p.row == row]
    parts.append(Text(f"KL(p_float64 ‖ p_{dtype}) of the next-token distributions: {said}"
                      + (f"; row {row}: " + " ".join(f"{k:.1e}" for k in mine)
                         if len(mine) <= KL_SHOWN else "")))
    diff = report.low_loss - report.loss
    parts.append(Text(f"loss  float64 {report.loss:.6f}  {dtype} {report.low_loss:.6f} "
                      f"({diff:+.1e})", style="bold"))
    return parts
