"""tfm patch: activation patching from a clean run into a corrupted one, beside attribution
patching's first-order estimate."""

from enum import Enum
from typing import Annotated, Optional

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (  # the corrupted run's and the metric's: tfm circuit's too
    FROM_OPTIONS,
    AnswerOption,
    Metric,
    MetricOption,
    WrongOption,
    check_metric,
    describe,
    emit,
    execute,
    metric_ids,
    patch_source,
    progress_bar,
    width,
)
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    with_options,
)


class Over(str, Enum):
    heads = "heads"
    sublayers = "sublayers"
    positions = "positions"


# (what other commands import from here stands above the command: the command's decorator
# imports every command module, tfm circuit's among them, which imports this one's)
def corrupted_labels(run, inputs) -> list[str]:
    """The corrupted run's tokens of row 0, as text."""
    return [run.token_text(int(t)) for t in inputs.tokens[0, :int(inputs.lengths[0])]]


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, FROM_OPTIONS, OUTPUT_OPTIONS)
def patch(
    over: Annotated[Over, typer.Option(
        "--over", case_sensitive=False, metavar="KIND", show_default=False,
        help="heads (the default), sublayers (attn, ffn) or positions.")
    ] = Over.heads,
    act: Annotated[Optional[str], typer.Option(
        "--act", metavar="NAME",
        help="--over positions: an activation (B, T, ...).")] = None,
    metric: MetricOption = Metric.loss,
    answer: AnswerOption = None,
    wrong: WrongOption = None,
    opts: Options = None,
):
    """Activation patching, clean into corrupted, beside attribution patching's estimate.

    Example: tfm patch --tokens 3,1,4,1,5 --from-tokens 1,2,3,4,5 -L 2
    """
    from tfmcli.engine.interventions import InterventionError
    from tfmcli.explain.patching import patching

    if not (opts.values.get("from_tokens") or opts.values.get("from_text")):
        raise typer.BadParameter("patching needs the corrupted run: add --from-tokens IDS or "
                                 "--from-text TEXT", param_hint="'--from-tokens'")
    if act is not None and over != Over.positions:
        raise typer.BadParameter("it names the activation whose positions are patched; add "
                                 "--over positions", param_hint="'--act'")
    check_metric(metric, answer, wrong)
    run, fwd, _ = execute(opts, with_grads=False)
    cfg = run.cfg
    corrupted = patch_source(opts, run).inputs
    ids = metric_ids(run, answer, wrong)
    if act is not None:
        from tfmcli.engine.interventions import resolve
        from tfmcli.engine.sizes import activation_shapes

        try:
            name = resolve(act, activation_shapes(cfg))[0]
        except InterventionError as e:
            raise typer.BadParameter(str(e), param_hint="'--act'") from None
        if name != act.strip() or len(activation_shapes(cfg)[name]) != 3:
            raise typer.BadParameter(f"{act!r}: --act takes an activation of shape (B, T, ...) "
                                     f"by its name, such as blocks.0.resid1",
                                     param_hint="'--act'")
    try:
        with progress_bar("patched runs") as tick:   # one forward pass a component
            grid = patching(run.params, run.inputs, corrupted, cfg, over.value, metric.value,
                            *ids, act=act, tokens=run.token_labels(0), progress=tick)
    except InterventionError as e:
        raise typer.BadParameter(str(e), param_hint="'--from-tokens'") from None
    what = {"loss": "the loss (clean targets)",
            "logit-diff": f"logit[{ids[0]}] - logit[{ids[1]}] at each row's last position"}
    rows = {**describe(cfg, run),
            "corrupted": render.token_line(corrupted_labels(run, corrupted)),
            "metric": f"{what[metric.value]}: clean {grid.clean:.6f}, corrupted "
                      f"{grid.corrupted:.6f}"}
    import numpy as np

    top = float(max(np.abs(grid.real).max(), np.abs(grid.estimate).max())) or 1.0

    def drawn(values, title, legend=False):   # one scale, one legend: the colours compare
        return render.heatmap(values, title=title, row_labels=grid.rows, col_labels=grid.cols,
                              width=width(), precision=3, vmin=-top, vmax=top, diverging=True,
                              legend=legend)

    parts = [render.config_panel(rows, title="tfm patch"),
             drawn(grid.real, "real effect: the metric patched - corrupted"),
             drawn(grid.estimate, "estimate: gradient at corrupted . (clean - corrupted)"),
             drawn(grid.difference, "estimate - real", legend=True),
             Text(ranking_line(grid)), Text(
                 "a cell: the metric's change when that component's clean values replace the "
                 "corrupted run's", style="dim")]
    payload = {"over": grid.over, "metric": grid.metric, "rows": grid.rows, "cols": grid.cols,
               "targets": grid.targets, "clean": grid.clean, "corrupted": grid.corrupted,
               "real": grid.real.tolist(), "estimate": grid.estimate.tolist(),
               "rank_correlation": grid.rank_correlation}
    from tfmcli.io import run_arrays

    arrays = {**run_arrays(cfg, run.params, run.inputs, fwd),   # the clean run, and the grids
              "patch/real": grid.real, "patch/estimate": grid.estimate}
    emit(opts, parts, payload, arrays)


def ranking_line(grid) -> str:
    """How well the estimate ranks the components: Spearman's, and the top three of each."""
    import numpy as np

    cells = [(r, c) for r in range(len(grid.rows)) for c in range(len(grid.cols))]

    def top(values):
        order = np.argsort(-np.abs(values.ravel()), kind="stable")[:3]
        return ", ".join(f"{grid.rows[cells[k][0]]} {grid.cols[cells[k][1]]}" for k in order)

    rho = grid.rank_correlation
    shown = "undefined (a constant grid)" if rho != rho else f"{rho:+.3f}"
    return (f"rank correlation of estimate and real (Spearman): {shown}\n"
            f"largest |real|:     {top(grid.real)}\nlargest |estimate|: {top(grid.estimate)}")
