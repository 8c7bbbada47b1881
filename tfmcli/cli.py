"""The tfm command line: gather options, build a Config, call the API, render.

Errors never reach a user as tracebacks: bad options are usage errors (exit 2, one line on
stderr naming the option), domain failures are ``TfmError`` (exit 1, one line).
"""

import json
import math
import os
import sys
from enum import Enum
from typing import Annotated, List, Optional

import numpy as np
import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

import tfmcli
from tfmcli import config as sizes
from tfmcli import render
from tfmcli.errors import TfmError
from tfmcli.io import jsonable, run_arrays, save_npz, save_text
from tfmcli.masks import additive, causal_mask, combined_mask, padding_mask
from tfmcli.model import first_nonfinite
from tfmcli.options import (MODEL_OPTIONS, OUTPUT_OPTIONS, RUN_OPTIONS, Options, bounded,
                            check_name, check_range, binary_size, parse_lengths, with_options)
from tfmcli.positional import sinusoidal, wavelengths
from tfmcli.steps import illustrated_steps, model_head_steps
from tfmcli.summary import stats

try:  # recent typer vendors click; older releases depend on it
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException


class OneLineErrors(TyperGroup):
    """Report every error as one line on stderr: usage errors exit 2, domain errors exit 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            with np.errstate(all="ignore"):  # statistics of huge values must not print warnings
                code = super().main(args=args, prog_name="tfm", complete_var=complete_var,
                                    standalone_mode=False, **extra)
        except ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) else "tfm"
            message = e.format_message().replace("Value error, ", "")  # typer's validator prefix
            if message:  # (no message: `tfm` alone, which has just printed its help)
                typer.echo(f"{where}: error: {message}", err=True)
            code = e.exit_code if message else 0
        except BrokenPipeError:  # `tfm ... | head`: the reader left; nothing to report
            sys.stderr.close()
            code = 0
        except TfmError as e:
            typer.echo(f"tfm: error: {e}", err=True)
            code = 1
        except MemoryError:
            typer.echo("tfm: error: out of memory; try smaller sizes (see tfm shapes)", err=True)
            code = 1
        except (typer.Abort, KeyboardInterrupt):
            typer.echo("tfm: interrupted", err=True)
            code = 130
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=OneLineErrors,
    help="See, number by number, what a transformer does forward and backward.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

Precision = Annotated[int, typer.Option("--precision", callback=bounded(0, 12), help="Digits after the point (0..12).")]
Row = Annotated[int, typer.Option("--row", callback=bounded(0), help="Batch row to show.")]
Show = Annotated[Optional[List[str]], typer.Option("--show", metavar="NAME", help="Print this tensor in full (repeatable).")]


def version_callback(value: bool):
    if value:
        typer.echo(f"tfm {tfmcli.__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[Optional[bool], typer.Option(
        "--version", callback=version_callback, is_eager=True, help="Print the version and exit.")] = None):
    """See, number by number, what a transformer does forward and backward.

    Try: tfm forward --seed 1000 | tfm backward --layer ffn | tfm mask --len 7
    """


# ---------------------------------------------------------------- output


def make_console(**kwargs) -> Console:
    """The console everything prints to: no escape codes at all when NO_COLOR is set."""
    plain = bool(os.environ.get("NO_COLOR"))
    return Console(highlight=False, color_system=None if plain else "auto", **kwargs)


def width() -> int:
    return make_console().width


def emit(opts: Options, renderables, payload, arrays=None):
    """Save, then print: JSON when --json, else the renderables (recorded for --svg)."""
    if arrays is not None and opts.values.get("save") is not None:
        save_npz(opts.save, arrays)
    if opts.json:
        typer.echo(json.dumps(payload))
        return
    console = make_console(record=opts.svg is not None)
    for item in renderables:
        console.print(item)
    if opts.svg is not None:
        save_text(opts.svg, console.export_svg(title="tfm"))


def describe(cfg) -> dict:
    """The config panel's rows."""
    mask = ("causal" if cfg.causal else "none") + (
        f" + padding {list(cfg.lengths)}" if cfg.lengths is not None else "")
    return {
        "sizes": f"B={cfg.batch} T={cfg.seq_len} d={cfg.d_model} H={cfg.heads} "
                 f"d_head={cfg.d_head} d_ff={cfg.ff} V={cfg.vocab} L={cfg.layers}",
        "norm": "Pre-LN (+ final ln_f)" if cfg.norm == "pre" else "Post-LN",
        "activation": cfg.activation + (" (tanh approx.)" if cfg.activation == "gelu" else ""),
        "mask": mask,
        "positional": cfg.pe,
        "init": cfg.init,
        "dtype": cfg.dtype,
        "eps": f"{cfg.eps:g}",
        "seed": str(cfg.seed),
        "parameters": f"{sizes.param_count(cfg):,}",
    }


def execute(opts: Options, with_grads: bool, validate=None):
    """Build the run the options describe; forward (and backward). Refuses NaN/Inf results.

    ``validate(cfg)`` checks the command's own options once the config is known, before
    anything is computed.
    """
    cfg, params, inputs = opts.run()
    if validate is not None:
        validate(cfg)
    params = tfmcli.init_params(cfg) if params is None else params
    inputs = tfmcli.make_inputs(cfg) if inputs is None else inputs
    try:
        # An overflow anywhere makes every later number meaningless (a layer norm of values
        # whose square overflows returns 0, not the right answer), so it stops the run.
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            fwd = tfmcli.forward(params, inputs, cfg)
            grads = tfmcli.backward(params, fwd, cfg) if with_grads else None
    except FloatingPointError as e:
        hint = " or --dtype float64" if cfg.dtype == "float32" else ""
        raise TfmError(f"the run overflowed {cfg.dtype} ({e}): values too large to be right; "
                       f"use smaller weights or inputs{hint}") from None
    bad = first_nonfinite(fwd.acts) or (with_grads and (first_nonfinite(grads)
                                                        or first_nonfinite(grads.acts)))
    if bad or not math.isfinite(fwd.loss):
        raise TfmError(f"the run produced NaN or Inf (first in {bad or 'the loss'}); "
                       f"try smaller weights (--init normal) or --dtype float64")
    return cfg, params, inputs, fwd, grads


def sliced(name: str, value: np.ndarray, row: int, head: int):
    """A tensor cut down to at most two axes by --row and --head, and a caption saying how."""
    if value.ndim <= 2:
        return value, f"{name} {value.shape}"
    cut = value[row]
    caption = f"{name}[{row}] of {value.shape}"
    if cut.ndim > 2:
        cut = cut[head]
        caption = f"{name}[{row}, {head}] of {value.shape}"
    return cut, caption


def check_indices(cfg, row=None, head=None, block=None):
    """--row, --head and --block must name a batch row, head and block of this run."""
    for value, upper, flag, what in ((row, cfg.batch, "--row", "batch rows"),
                                     (head, cfg.heads, "--head", "heads"),
                                     (block, cfg.layers, "--block", "blocks")):
        if value is not None:
            check_range(value, upper, flag, what)


def check_show(cfg, names, gradient=False):
    """Every --show NAME must be an activation or a parameter of this config."""
    known = [*sizes.activation_shapes(cfg), *sizes.param_shapes(cfg)]
    for name in names or []:
        check_name(name, known, gradient=gradient)


def show_tensors(tensors: dict, names, precision, row, head, gradient=False):
    """Renderables and JSON for each --show NAME (already checked), cut by --row/--head.

    With ``gradient``, ``tensors`` are gradients, shown and keyed as 'd' + name.
    """
    prefix = "d" if gradient else ""
    shown, payload = [], {}
    for raw in names or []:
        name = check_name(raw, tensors, gradient=gradient)
        value = tensors[name]
        cut, caption = sliced(prefix + name, value, row, head)
        shown.append(render.tensor_table(cut, title=caption, precision=precision, full=True,
                                         width=width()))
        payload[prefix + name] = {"shape": list(value.shape), "values": jsonable(value)}
    return shown, payload


# ---------------------------------------------------------------- forward


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def forward(
    show: Show = None,
    row: Row = 0,
    head: Annotated[Optional[int], typer.Option("--head", callback=bounded(0), help="Only this head's heatmap (and --show slice).")] = None,
    block: Annotated[Optional[int], typer.Option("--block", callback=bounded(0), help="Only this block's heatmaps.")] = None,
    precision: Precision = 4,
    full: Annotated[bool, typer.Option("--full", help="Every attention map and trace row, none elided.")] = False,
    opts: Options = None,
):
    """Run the forward pass: config, shape trace of every activation, attention maps, loss.

    Example: tfm forward --seed 1000 --show blocks.0.attn.pattern --row 1
    """
    def validate(cfg):
        check_indices(cfg, row, head, block)
        check_show(cfg, show)

    cfg, params, inputs, fwd, _ = execute(opts, with_grads=False, validate=validate)
    shown, shown_json = show_tensors({**fwd.acts, **params}, show, precision, row, head or 0)
    maps = attention_maps(fwd, cfg, row, block, head, full)
    parts = [render.config_panel(describe(cfg), title="tfm forward"),
             render.shape_trace(fwd.acts, precision=precision, max_rows=rows_limit(full)),
             render.side_by_side(*maps), *shown,
             Text(f"loss = {fwd.loss:.{precision + 2}f}  (mean cross-entropy over "
                  f"{int(inputs.lengths.sum())} positions)", style="bold")]
    payload = {"config": json.loads(cfg.to_json()), "parameters": sizes.param_count(cfg),
               "loss": fwd.loss,
               "activations": [{"name": name, **stats(value)} for name, value in fwd.acts.items()],
               "show": shown_json}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd))


MAX_MAPS = 8
SCREEN_ROWS = 80
MAX_ROWS = 40  # table rows shown without --full: one screenful
Full = Annotated[bool, typer.Option("--full", help="Every row, none elided.")]


def rows_limit(full: bool):
    return None if full else MAX_ROWS


def attention_maps(fwd, cfg, row, block, head, full):
    """Heatmaps of the attention pattern of each (block, head) for one batch row."""
    blocks = range(cfg.layers) if block is None else [block]
    heads = range(cfg.heads) if head is None else [head]
    pairs = [(b, h) for b in blocks for h in heads]
    # about a screenful of maps: eight small ones, or a single long one (a map is drawn at most
    # (width - 6) / 2 rows tall: downsampled to fit the width, it stays square)
    map_rows = min(cfg.seq_len, (width() - 6) // 2) + 4
    shown = pairs if full else pairs[:max(1, min(MAX_MAPS, SCREEN_ROWS // map_rows))]
    patterns = [fwd.acts[f"blocks.{b}.attn.pattern"][row, h] for b, h in shown]
    T = cfg.seq_len
    mask = combined_mask(fwd.inputs.lengths, T, cfg.causal)[row]
    # One colour scale for all maps, comparable across heads: 0 to the 99th percentile of the
    # weights shown (higher ones saturate), so that a long sequence, whose weights are mostly
    # near 1/T beside a few near 1, still shows its structure.
    vmax = float(np.quantile(np.concatenate([p[mask] for p in patterns]), 0.99))
    digits = max(2, 1 - math.floor(math.log10(vmax / 4)))  # legend stops vmax/4 apart differ
    maps = [render.heatmap(
        pattern, title=f"block {b} head {h}: attention pattern, batch row {row}",
        row_labels=[f"q{t}" for t in range(T)], col_labels=[f"k{t}" for t in range(T)],
        mask=mask, width=width(), vmin=0.0, vmax=vmax, precision=digits)
        for (b, h), pattern in zip(shown, patterns)]
    if any(p.max() > vmax for p in patterns):
        maps.append(Text(f"colour scale 0..{vmax:.{digits}f}, the 99th percentile of the "
                         f"weights shown; larger weights take the top colour", style="dim"))
    if len(pairs) > len(shown):
        maps.append(Text(f"showing {len(shown)} of {len(pairs)} attention maps; "
                         f"pick with --block/--head, or --full for all", style="dim"))
    return maps


# ---------------------------------------------------------------- backward

Layer = Enum("Layer", {name: name for name in ("embed", "attn", "ln1", "ln2", "ffn", "ln_f",
                                               "head", "all")}, type=str)


def layer_of(name: str) -> str:
    """'blocks.0.ffn.W_1' -> 'ffn'; 'embed.W_E' -> 'embed'."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blocks" else parts[0]


def default_max_entries(cfg) -> Optional[int]:
    """Check every entry of a small model; sample 32 per tensor of a big one."""
    return None if sizes.param_count(cfg) <= 5000 else 32


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def backward(
    layer: Annotated[Layer, typer.Option("--layer", case_sensitive=False, help="Only this layer's parameters.")] = Layer.all,
    block: Annotated[Optional[int], typer.Option("--block", callback=bounded(0), help="Only this block's parameters.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Add the central-difference error of each parameter.")] = False,
    show: Show = None,
    row: Row = 0,
    head: Annotated[int, typer.Option("--head", callback=bounded(0), help="Head of a 4-D --show tensor.")] = 0,
    precision: Precision = 4,
    full: Full = False,
    opts: Options = None,
):
    """Forward + hand-written backward: a gradient table per parameter (and --check).

    Example: tfm backward --layer ffn --check --show dlogits
    """
    layer = layer.value
    names = []

    def validate(cfg):
        check_indices(cfg, row, head, block)
        check_show(cfg, show, gradient=True)
        if layer == "ln_f" and cfg.norm == "post":
            raise typer.BadParameter("Post-LN has no ln_f; use --norm pre", param_hint="'--layer'")
        names.extend(n for n in sizes.param_shapes(cfg)
                     if (layer == "all" or layer_of(n) == layer)
                     and (block is None or n.startswith(f"blocks.{block}.")))
        if not names:
            raise typer.BadParameter(f"no parameter of layer {layer!r} in block {block}",
                                     param_hint="'--layer'")

    cfg, params, inputs, fwd, grads = execute(opts, with_grads=True, validate=validate)
    report = None
    if check:
        report = run_gradcheck(params, inputs, cfg, names, default_max_entries(cfg), None, None)
    checks = {c.name: c for c in report.params} if report else None
    # --show: a parameter's gradient by its name, an activation's by its name (or 'd' + name)
    shown, shown_json = show_tensors({**grads.acts, **grads}, show, precision, row, head,
                                     gradient=True)
    parts = [render.config_panel(describe(cfg), title="tfm backward"),
             render.grad_table({n: grads[n] for n in names}, checks, precision=precision,
                               max_rows=rows_limit(full)),
             *shown, Text(f"loss = {fwd.loss:.{precision + 2}f}", style="bold")]
    if report is not None:
        parts.append(verdict(report))
    payload = {"config": json.loads(cfg.to_json()), "loss": fwd.loss,
               "gradients": [grad_row(n, grads[n], checks) for n in names], "show": shown_json}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd, grads))
    if report is not None and not report.passed:
        raise TfmError(f"gradcheck failed for {', '.join(report.failed)}")


def grad_row(name, g, checks):
    row = {"name": name, "shape": list(g.shape), "l2": float(np.sqrt((g.astype(np.float64) ** 2).sum())),
           "max_abs": float(np.abs(g).max()), "mean": float(g.mean())}
    if checks and name in checks:
        row.update(rel_err=checks[name].rel_err, passed=checks[name].passed)
    return row


def verdict(report) -> Text:
    if report.passed:
        return Text(f"gradcheck passed: worst relative error {report.worst.rel_err:.2e} "
                    f"({report.worst.name}) <= {report.tolerance:g}", style="bold green")
    return Text(f"gradcheck FAILED for {', '.join(report.failed)} (tolerance "
                f"{report.tolerance:g})", style="bold red")


def run_gradcheck(params, inputs, cfg, names, max_entries, step, tolerance):
    """tfmcli.gradcheck with a progress bar on a terminal when there is much to do."""
    kwargs = {"names": names, "max_entries": max_entries}
    if step is not None:
        kwargs["step"] = step
    if tolerance is not None:
        kwargs["tolerance"] = tolerance
    console = Console(stderr=True)
    if not console.is_terminal:
        return tfmcli.gradcheck(params, inputs, cfg, **kwargs)
    from rich.progress import Progress
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("central differences", total=None)
        kwargs["progress"] = lambda done, total: progress.update(task, completed=done, total=total)
        return tfmcli.gradcheck(params, inputs, cfg, **kwargs)


# ---------------------------------------------------------------- gradcheck


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def gradcheck(
    max_entries: Annotated[Optional[int], typer.Option("--max-entries", callback=bounded(1), help="Check at most N sampled entries per tensor (default: all when the model has <= 5,000 parameters, else 32).")] = None,
    step: Annotated[float, typer.Option("--step", help="Finite-difference step h.")] = 1e-5,
    full: Full = False,
    tol: Annotated[Optional[float], typer.Option("--tol", help="Largest relative error that passes (default 1e-6 for float64, 1e-3 for float32).")] = None,
    opts: Options = None,
):
    """Check every parameter's gradient against central differences; exit 1 if any fails.

    Example: tfm gradcheck --norm post --activation gelu --lengths 4,2 -L 2
    """
    for flag, value in (("--step", step), ("--tol", tol)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise typer.BadParameter(f"{value} is not allowed (allowed: a positive number)",
                                     param_hint=f"'{flag}'")
    cfg, params, inputs, fwd, grads = execute(opts, with_grads=True)
    entries = max_entries if max_entries is not None else default_max_entries(cfg)
    report = run_gradcheck(params, inputs, cfg, None, entries, step, tol)
    checks = {c.name: c for c in report.params}
    parts = [render.config_panel(describe(cfg), title="tfm gradcheck"),
             render.grad_table(dict(grads), checks, max_rows=rows_limit(full)),
             Text(f"numeric gradient: (L(p+h) - L(p-h)) / 2h in float64, h = {step:g}; error = "
                  f"max |analytic - numeric| / largest |gradient| of the tensor", style="dim"),
             verdict(report)]
    payload = {"passed": report.passed, "tolerance": report.tolerance, "step": report.step,
               "dtype": report.dtype, "failed": report.failed,
               "params": [{"name": c.name, "shape": list(c.shape), "checked": c.checked,
                           "max_abs_err": c.max_abs_err, "rel_err": c.rel_err,
                           "passed": c.passed} for c in report.params]}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd, grads))
    if not report.passed:
        raise TfmError(f"gradcheck failed for {', '.join(report.failed)}")


# ---------------------------------------------------------------- shapes


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:,.1f} {suffix}{unit}".replace(".0 ", " ")
        n /= 1000
    return f"{n:,.1f} E{unit}"


@app.command()
@with_options(MODEL_OPTIONS, [spec for spec in OUTPUT_OPTIONS if spec[0] != "save"])
def shapes(full: Full = False, opts: Options = None):
    """Every tensor's shape, parameter counts, FLOPs and memory, without allocating anything.

    Example: tfm shapes -d 768 -H 12 -T 1024 -V 50257
    """
    cfg = opts.config()
    pshapes, ashapes = sizes.param_shapes(cfg), sizes.activation_shapes(cfg)
    fwd_flops, bwd_flops = sizes.flops(cfg)
    memory = sizes.memory_estimate(cfg)
    groups = sizes.param_groups(cfg)
    rows = {"parameters": f"{sizes.param_count(cfg):,}  (" + ", ".join(
                f"{g} {n:,}" for g, n in groups.items()) + ")",
            "FLOPs": f"forward {human(fwd_flops)}, backward {human(bwd_flops)} (matmuls, "
                     f"attention included)",
            "memory": f"{binary_size(memory['total'])} peak forward + backward (activations "
                      f"{binary_size(memory['activations'])})"}
    parts = [render.config_panel({**describe(cfg), **rows}, title="tfm shapes"),
             render.shape_list(pshapes, title="parameters", max_rows=rows_limit(full)),
             render.shape_list(ashapes, title="activations (forward order)", max_rows=rows_limit(full))]
    payload = {"config": json.loads(cfg.to_json()),
               "params": {n: list(s) for n, s in pshapes.items()},
               "activations": {n: list(s) for n, s in ashapes.items()},
               "param_groups": dict(groups), "param_count": sizes.param_count(cfg),
               "flops": {"forward": fwd_flops, "backward": bwd_flops}, "memory": memory}
    emit(opts, parts, payload)


# ---------------------------------------------------------------- attn


@app.command()
@with_options(MODEL_OPTIONS, RUN_OPTIONS, OUTPUT_OPTIONS)
def attn(
    example: Annotated[Optional[str], typer.Option("--example", help="'illustrated': seed 002's integer worked example instead of the model.")] = None,
    block: Annotated[int, typer.Option("--block", callback=bounded(0), help="Block of the head.")] = 0,
    head: Annotated[int, typer.Option("--head", callback=bounded(0), help="Head to follow.")] = 0,
    row: Row = 0,
    precision: Precision = 4,
    opts: Options = None,
):
    """One attention head step by step: X, Q, K, V, scores, scaled, masked, softmax, context.

    Example: tfm attn --example illustrated
    """
    if example not in (None, "illustrated"):
        raise typer.BadParameter(f"{example!r} is not a known example; the one there is: "
                                 f"illustrated", param_hint="'--example'")
    if example == "illustrated":
        unscaled, scaled = illustrated_steps(1.0), illustrated_steps(1 / math.sqrt(3))
        parts = [Text("Seed 002's worked example: X (3x4) and integer W_Q, W_K, W_V (4x3), no "
                      "mask, no biases. The note's code takes softmax(Q K^T) WITHOUT the "
                      "1/sqrt(d_k) scale: that result is on the left; the scaled one "
                      "(d_k = 3, as the formula says) on the right.", style="bold")]
        parts += render_steps(unscaled[:5], precision)
        for a, b in zip(unscaled[7:], scaled[7:]):
            parts.append(render.side_by_side(
                render.tensor_table(a.value, title=f"{a.name}, unscaled (the note's code)", precision=precision),
                render.tensor_table(b.value, title=f"{b.name}, scaled by 1/sqrt(3)", precision=precision)))
        payload = {"example": "illustrated",
                   "unscaled": {s.name: jsonable(s.value) for s in unscaled},
                   "scaled": {s.name: jsonable(s.value) for s in scaled}}
        arrays = {f"unscaled/{s.name}": s.value for s in unscaled}
        arrays.update({f"scaled/{s.name}": s.value for s in scaled})
        emit(opts, parts, payload, arrays)
        return
    cfg, params, inputs, fwd, _ = execute(
        opts, with_grads=False, validate=lambda cfg: check_indices(cfg, row, head, block))
    steps = model_head_steps(params, fwd, cfg, block, head, row)
    parts = [render.config_panel(describe(cfg), title=f"tfm attn: block {block}, head {head}, "
                                                     f"batch row {row}")]
    parts += render_steps(steps, precision)
    payload = {"block": block, "head": head, "row": row,
               "steps": [{"name": s.name, "formula": s.formula, "value": jsonable(s.value)}
                         for s in steps]}
    emit(opts, parts, payload, run_arrays(cfg, params, inputs, fwd))


def render_steps(steps, precision):
    parts = []
    for i, step in enumerate(steps, 1):
        parts.append(Text.assemble((f"{i}. {step.name} {step.value.shape}", "bold"),
                                   f"   {step.formula}"))
        parts.append(render.tensor_table(step.value, precision=precision, width=width(),
                                         mask=step.mask))
    return parts


# ---------------------------------------------------------------- mask

MAX_GRID = 40  # beyond this, a mask is drawn as a downsampled heatmap, not one cell per entry


def mask_view(grid, title, additive_form, row_labels, col_labels):
    """A mask as a grid of symbols, or, when it is big, as a heatmap fitted to the terminal."""
    if max(grid.shape) <= MAX_GRID:
        return render.mask_grid(grid, title=title, additive=additive_form,
                                row_labels=row_labels, col_labels=col_labels)
    return render.heatmap(grid.astype(float), title=title, mask=grid, row_labels=row_labels,
                          col_labels=col_labels, width=width(), vmin=0.0, vmax=1.0,
                          legend=False, show_values=False)


@app.command()
@with_options([spec for spec in OUTPUT_OPTIONS])
def mask(
    length: Annotated[int, typer.Option("--len", callback=bounded(1, 1024), help="Sequence length N (1..1024).")] = 7,
    lengths: Annotated[Optional[str], typer.Option("--lengths", metavar="4,2,6", help="Valid length of each batch row (1..N).")] = None,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Include the look-ahead (causal) mask.")] = True,
    additive_form: Annotated[bool, typer.Option("--additive", help="Show the 0 / -inf form added to the scores.")] = False,
    opts: Options = None,
):
    """The causal grid, the padding rows and each row's combined mask (True = may attend).

    Example: tfm mask --len 7 --lengths 4,2,6
    """
    rows = parse_lengths(lengths) or (length,)
    bad = [n for n in rows if not 1 <= n <= length]
    if bad:
        raise typer.BadParameter(f"{bad[0]} is outside 1..{length} (--len)", param_hint="'--lengths'")
    causal_grid = causal_mask(length) if causal else np.ones((length, length), dtype=bool)
    pad = padding_mask(rows, length)
    combined = combined_mask(rows, length, causal)
    queries, keys = [f"q{t}" for t in range(length)], [f"k{t}" for t in range(length)]
    grids = [mask_view(causal_grid, "causal (look-ahead)" if causal else "no causal mask",
                       additive_form, queries, keys),
             mask_view(pad, f"padding, lengths {list(rows)}", additive_form,
                       [f"row {b}" for b in range(len(rows))], keys)]
    grids += [mask_view(combined[b], f"combined, row {b} (length {n})", additive_form, queries, keys)
              for b, n in enumerate(rows[:MAX_MAPS])]
    if len(rows) > MAX_MAPS:
        grids.append(Text(f"showing the combined masks of {MAX_MAPS} of {len(rows)} rows "
                          f"(--json has all)", style="dim"))
    parts = [render.mask_legend(additive_form), render.side_by_side(*grids)]
    payload = {"causal": causal_grid.tolist(), "padding": pad.tolist(), "combined": combined.tolist()}
    if additive_form:
        payload["additive"] = jsonable(additive(combined))
    arrays = {"causal": causal_grid, "padding": pad, "combined": combined}
    emit(opts, parts, payload, arrays)


# ---------------------------------------------------------------- pe


@app.command()
@with_options([spec for spec in OUTPUT_OPTIONS])
def pe(
    length: Annotated[int, typer.Option("--len", callback=bounded(1, 100_000), help="Positions N.")] = 16,
    d_model: Annotated[int, typer.Option("--d-model", "-d", callback=bounded(1, 100_000), help="Width d (odd allowed: the last column is a sine).")] = 16,
    precision: Precision = 3,
    opts: Options = None,
):
    """The sinusoidal positional-encoding matrix as a heatmap, each column sin/cos + wavelength.

    Example: tfm pe --len 16 --d-model 8
    """
    if length * d_model > 20_000_000:
        raise typer.BadParameter(f"{length} x {d_model} is {length * d_model:,} values; at most "
                                 f"20,000,000", param_hint="'--len' / '--d-model'")
    matrix = sinusoidal(length, d_model)
    waves = wavelengths(d_model)
    col_labels = [f"{'sin' if j % 2 == 0 else 'cos'} λ{waves[j]:.3g}" for j in range(d_model)]
    rows = [f"p{p}" for p in range(length)]
    parts = [Text("PE[p, 2i] = sin(p / 10000^(2i/d)),  PE[p, 2i+1] = cos(p / 10000^(2i/d));  "
                  "λ = wavelength in positions = 2π·10000^(2i/d)", style="bold")]
    if 2 * d_model + 8 <= width():  # every column fits: the matrix as it is
        parts.append(render.heatmap(matrix, title=f"positional encoding ({length} x {d_model})",
                                    row_labels=rows, col_labels=col_labels, width=width(),
                                    vmin=-1.0, vmax=1.0, diverging=True, precision=precision))
    else:  # the sine and cosine columns apart, so that shrinking never averages a sin with a cos
        for kind, first in (("sin", 0), ("cos", 1)):
            parts.append(render.heatmap(
                matrix[:, first::2], title=f"{kind} columns {first}, {first + 2}, ... of the "
                                           f"positional encoding ({length} x {d_model})",
                row_labels=rows, col_labels=col_labels[first::2], width=width(),
                vmin=-1.0, vmax=1.0, diverging=True, precision=precision))
    if length * d_model <= 256:
        parts.append(render.tensor_table(matrix, title="values", precision=precision,
                                         col_labels=col_labels, width=width()))
    emit(opts, parts, {"pe": jsonable(matrix)}, {"pe": matrix})


def main():
    app()
