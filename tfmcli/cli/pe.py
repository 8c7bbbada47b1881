"""tfm pe: the sinusoidal positional-encoding matrix."""

from typing import Annotated

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Precision, emit, width
from tfmcli.cli.options import OUTPUT_OPTIONS, Options, bounded, with_options


@app.command()
@with_options([spec for spec in OUTPUT_OPTIONS])
def pe(
    length: Annotated[int, typer.Option("--len", "-T", callback=bounded(1, 100_000), help="Positions N.")] = 16,
    d_model: Annotated[int, typer.Option("--d-model", "-d", callback=bounded(1, 100_000), help="Width d (odd allowed: the last column is a sine).")] = 16,
    precision: Precision = 3,
    opts: Options = None,
):
    """The sinusoidal positional-encoding matrix as a heatmap, each column sin/cos + wavelength.

    Example: tfm pe --len 16 --d-model 8
    """
    from tfmcli.io import jsonable
    from tfmcli.positional import sinusoidal, wavelengths

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
                                    row_labels=rows, col_labels=[str(j) for j in range(d_model)],
                                    width=width(), vmin=-1.0, vmax=1.0, diverging=True,
                                    precision=precision))
        parts.append(Text(f"column j: sin for even j, cos for odd j; wavelength λ = "
                          f"{waves[0]:.3g} (j = 0, 1) up to {waves[-1]:.3g} (j = {d_model - 1})",
                          style="dim"))
    else:  # the sine and cosine columns apart, so that shrinking never averages a sin with a cos
        for kind, first in (("sin", 0), ("cos", 1)):
            parts.append(render.heatmap(
                matrix[:, first::2], title=f"{kind} columns {first}, {first + 2}, ... of the "
                                           f"positional encoding ({length} x {d_model})",
                row_labels=rows, col_labels=col_labels[first::2], width=width(),
                vmin=-1.0, vmax=1.0, diverging=True, precision=precision))
    if length * d_model <= 256:
        parts.append(render.tensor_table(matrix, title="values", precision=precision, row_labels=rows,
                                         col_labels=col_labels, width=width()))
    emit(opts, parts, {"pe": jsonable(matrix)}, {"pe": matrix})
