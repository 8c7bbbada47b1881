"""tfm precision: the run in float32, float16 or bfloat16 held against float64, tensor by tensor."""

import json
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Full,
    Row,
    blocks_bar,
    check_indices,
    describe,
    emit,
    rows_limit,
    width,
)
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    DType,
    Options,
    with_options,
)

KL_SHOWN = 16   # positions of --row whose KL divergence the view lists (--json: every one)


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def precision(
    threshold: Annotated[float, typer.Option(
        "--threshold", min=0.0, help="Name the first tensor past this many eps.")] = 4.0,
    against: Annotated[Optional[Path], typer.Option(
        "--against", metavar="FILE|DIR",
        help="The original of --load's quantized model: the quantization lens.")] = None,
    row: Row = 0,
    full: Full = False,
    opts: Options = None,
):
    """The run in bfloat16 (or --dtype) against float64: every tensor's error, own and inherited.

    --against DIR|FILE: a quantized --load against its original, weights, then the runs.

    Example: tfm precision --arch llama -L 4 --dtype float16
    """
    from tfmcli.engine.memory import keep_freed_memory
    from tfmcli.explain.precision import held_against_float64

    if against is not None and opts.values.get("load") is None:
        raise typer.BadParameter("the lens holds --load's model against its original: give "
                                 "--load FILE.gguf too", param_hint="'--against'")
    default = "float64" if against is not None else "bfloat16"
    dtype = opts.values["dtype"].value if opts.explicit("dtype") else default
    if dtype == "float64" and against is None:
        raise typer.BadParameter("float64 is the truth tfm precision holds the run against; "
                                 "give the dtype to measure: float32, float16 or bfloat16 (or "
                                 "the original of a quantized --load: --against)",
                                 param_hint="'--dtype'")
    opts.values["dtype"] = DType.float64   # the weights read in float64 (an .npz: in its own)
    keep_freed_memory()
    run = opts.run(untyped={"dtype"})
    cfg = run.cfg.replace(dtype="float64")
    check_indices(cfg, row)
    original = None if against is None else original_run(against, run, cfg)
    estimate = streams(opts, run, cfg, dtype, original is not None)
    stream = estimate is not None
    if stream and opts.values.get("save"):
        raise typer.BadParameter("a streamed comparison lets every tensor go once measured: "
                                 "there is no run to save (--json carries every error)",
                                 param_hint="'--save'")
    params = weights(run, stream)
    lens = weights_lens = unit = None
    names = ("float64", None)
    if original is not None:   # the original is the truth; --load's model runs in the dtype
        from tfmcli.explain.quantization import weight_errors, weights_error

        lens = params
        params = weights(original, stream)
        stored = run.lazy_params() if run.lazy_params is not None else None
        kinds = {n: stored.kind(n) for n in stored} if hasattr(stored, "kind") else None
        weights_lens = weight_errors(lens, params, kinds)
        unit = weights_error(weights_lens) if dtype == "float64" else None
        names = ("original", "quantized")
    if stream:
        from tfmcli.cli.options import binary_size

        run.streamed = (f"a block at a time (--stream): about {binary_size(estimate)}, "
                        f"weights {'read as used' if run.lazy_params else 'in memory'}")
    with blocks_bar(cfg, estimate, True) as (forward_tick, backward_tick):
        def tick(done: int, total: int):   # the forward's blocks, then the backward's
            half = total // 2
            if forward_tick is not None:
                (forward_tick if done <= half else backward_tick)((done - 1) % half + 1, half)

        report = held_against_float64(params, run.inputs, cfg, dtype, threshold, stream,
                                      tick, low_params=lens, unit=unit, names=names)
    panel = describe(cfg, run, row)
    parts = []
    if original is None:
        panel["dtype"] = f"{dtype}, held against float64"
        ours, truth, eps_name = dtype, "float64", f"{dtype}'s eps"
        rounded = f"rounded to {dtype}"
    else:
        panel["against"] = f"{original.weights_from}, in float64"
        panel["dtype"] = ("float64 both: the weights' error alone" if dtype == "float64" else
                          f"{dtype} (the quantized model's run), the original in float64")
        ours, truth = ("quantized" + ("" if dtype == "float64" else f", {dtype}"), "original")
        eps_name = ("the weights' error (their RMS relative error)" if dtype == "float64"
                    else f"{dtype}'s eps")
        rounded = "with the quantized weights" + ("" if dtype == "float64" else
                                                  f", rounded to {dtype}")
        parts.append(lens_table(weights_lens, rows_limit(full)))
    eps = report.eps
    parts[:0] = [render.config_panel(panel, title="tfm precision")]
    parts.append(Text(
        f"RMS, max: |{ours} - {truth}| over the tensor's {truth} RMS\n"
        f"eps: the RMS in {eps_name}, {eps:.2g}"
        + (f" (2^{int(np.log2(eps))})" if original is None or dtype != "float64" else "")
        + f"; ◀ past {threshold:g}\n"
        f"own: the operation on {truth}'s inputs, {rounded} (in eps)\n"
        f"inh.: inherited, what its inputs' error adds (in eps)\n"
        f"inf NaN →0: entries made inf, NaN, 0 or subnormal where {truth}'s are not",
        style="dim"))
    for title, errors, prefix in (("activations, forward", report.activations, ""),
                                  ("their gradients, backward", report.gradients, ""),
                                  ("the parameters' gradients", report.parameters, "grad ")):
        parts.append(error_table(title, errors, report.threshold, rows_limit(full), prefix))
    parts += summary(report, cfg, run, row, (truth, ours))
    payload = {"config": json.loads(cfg.replace(dtype=dtype).to_json()), **report.to_dict(),
               "row": row}
    if original is not None:
        payload["against"] = original.weights_from
        payload["weights"] = [w.to_dict() for w in weights_lens]
        payload["unit"] = "eps" if unit is None else "weights' relative RMS error"
    arrays = None
    if not stream:
        from tfmcli.io import run_arrays

        arrays = run_arrays(cfg, params, run.inputs, report.truth, report.truth_grads)
    emit(opts, parts, payload, arrays)


def weights(run, stream: bool):
    """A run's weights in float64: read as the pass uses them when streamed from files,
    else whole."""
    if stream and run.lazy_params is not None:   # the weights stay in their files
        return run.lazy_params()
    return {name: np.asarray(value, dtype=np.float64)
            for name, value in run.complete().params.items()}


def original_run(path: Path, run, cfg):
    """The model at ``path`` (--against), read in float64 on --load's tokens; a usage error
    naming --against when it cannot be read or is not --load's model."""
    import dataclasses

    from tfmcli.errors import TfmError
    from tfmcli.sources import load

    rows = [list(map(int, tokens[:n])) for tokens, n in zip(run.inputs.tokens,
                                                            run.inputs.lengths)]
    try:
        original = load(path, tokens=rows, dtype="float64")
    except (TfmError, ValueError) as e:
        raise typer.BadParameter(str(e).replace("--load ", "", 1),
                                 param_hint="'--against'") from None
    theirs = original.cfg.replace(dtype="float64")
    for field in dataclasses.fields(cfg):
        ours, other = getattr(cfg, field.name), getattr(theirs, field.name)
        if field.name not in ("seed", "init", "n_ctx") and ours != other:
            raise typer.BadParameter(
                f"{path} is not the original of --load's model: its {field.name} is "
                f"{other!r}, --load's {ours!r}", param_hint="'--against'")
    return original


def lens_table(errors, max_rows):
    """One row per weight: its stored type, and what quantization did to it."""
    rows = [[e.name, e.kind or "·", *("0" if x == 0 else _error(x) for x in (e.rel_rms,
                                                                            e.rel_max))]
            for e in errors]
    return render.record_table(["weight", "stored", "RMS", "max"], rows, max_rows=max_rows,
                               title="the weights: |quantized - original| over the "
                                     "original's RMS (max: its largest |w|)")


def streams(opts: Options, run, cfg, dtype: str, lens: bool = False) -> int | None:
    """Whether the three runs go a block at a time, letting each block's tensors and weights
    go once measured (then its estimate in bytes, else None): --stream, --no-stream, or
    (neither) when the whole comparison does not fit in the memory available and the
    streamed one does. One that fits neither way is refused before anything is allocated,
    unless --force."""
    from tfmcli.cli.options import available_memory, binary_size
    from tfmcli.engine.sizes import memory_estimate, streamed_estimate

    low = cfg.replace(dtype=dtype)
    wanted, force = opts.values.get("stream"), opts.values.get("force", False)
    lazy = run.lazy_params is not None

    def three(estimate) -> int:
        """float64's run and two in the dtype, which read one rounded copy of the weights
        (with the lens, the original's weights in float64 too)."""
        truth, rounded = estimate(cfg), estimate(low)
        return (truth["total"] + 2 * rounded["total"] - rounded["params"]
                + (truth["params"] if lens else 0))

    whole = three(memory_estimate)
    bare = three(lambda c: streamed_estimate(c, lazy))
    have = available_memory()
    if wanted is None:
        wanted = not force and whole > have and bare <= have
    if not force:
        need = bare if wanted else whole
        if need > have:
            way = "" if wanted or bare > have else f", or --stream (about {binary_size(bare)})"
            raise typer.BadParameter(
                f"a float64 run and two in {dtype} need about {binary_size(need)} "
                f"{'a block at a time ' if wanted else ''}(see tfm shapes), more than the "
                f"{binary_size(have)} available; shrink --batch, --seq-len or --layers{way}, "
                f"or pass --force", param_hint=" / ".join(f"'{f}'" for f in opts.sizing())
                or "'--batch' / '--seq-len'")
    return bare if wanted else None


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


def summary(report, cfg, run, row: int, names=("float64", None)) -> list:
    """The first tensors past the threshold, the residual stream's error block by block, the
    next tokens where the two runs' differ, their KL divergence, and the loss in both.
    ``names``: the truth's and the other run's (None: the dtype's)."""
    from tfmcli.explain.precision import NEAR_TIE

    truth, dtype, parts = names[0], names[1] or report.dtype, []
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
            ["row, position", "token", f"{truth} next", f"{dtype} next", "gap", "error", ""],
            rows, title=f"the most likely next token flips at {len(flips)} of "
                        f"{len(report.positions)} positions", left=4)
        table.caption = (f"gap: {truth}'s top two logits apart, in eps of their "
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
    parts.append(Text(f"KL(p_{truth} ‖ p_{dtype}) of the next-token distributions: {said}"
                      + (f"; row {row}: " + " ".join(f"{k:.1e}" for k in mine)
                         if len(mine) <= KL_SHOWN else "")))
    diff = report.low_loss - report.loss
    parts.append(Text(f"loss  {truth} {report.loss:.6f}  {dtype} {report.low_loss:.6f} "
                      f"({diff:+.1e})", style="bold"))
    return parts
