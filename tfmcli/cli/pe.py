"""tfm pe: the sinusoidal positional-encoding matrix, RoPE's angles (--rope), or ALiBi's
slopes and biases (--alibi)."""

import math
from typing import Annotated, Optional

import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Precision, emit, width
from tfmcli.cli.options import OUTPUT_OPTIONS, Options, bounded, with_options


@app.command()
@with_options([spec for spec in OUTPUT_OPTIONS])
def pe(
    length: Annotated[int, typer.Option(
        "--len", "-T", callback=bounded(1, 100_000), help="Positions N.")] = 16,
    d_model: Annotated[int, typer.Option(
        "--d-model", "-d", callback=bounded(1, 100_000),
        help="Width d (odd allowed: the last column is a sine); with --rope a head's width "
             "d_head.")] = 16,
    rope: Annotated[bool, typer.Option(
        "--rope",
        help="RoPE instead: each pair's angle at each position, and the score of one vector "
             "against itself turned, which depends on the offset only.")] = False,
    rope_theta: Annotated[float, typer.Option(
        "--rope-theta", help="RoPE's base, with --rope (LLaMA 3: 500000) (> 0).")] = 10000.0,
    rope_scaling: Annotated[Optional[str], typer.Option(
        "--rope-scaling", metavar="32,1,4,8192",
        help="Scaled RoPE, with --rope: the four numbers of LLaMA 3.1's llama3 rope_scaling, "
             "factor, low and high freq factors, original context (LLaMA 3.2: 32,1,4,8192); "
             "or one number, linear scaling's factor (Gemma 3 4B+: 8).")] = None,
    alibi: Annotated[bool, typer.Option(
        "--alibi",
        help="ALiBi instead: each head's slope m and the bias -m (i - j) it adds to its score of "
             "query i at key j (BLOOM, MPT).")] = False,
    heads: Annotated[int, typer.Option(
        "--heads", "-H", callback=bounded(1, 4096),
        help="Heads, with --alibi: each takes its own slope (1..4096).")] = 8,
    rotary_dim: Annotated[Optional[int], typer.Option(
        "--rotary-dim",
        help="RoPE on the first N of the head's dimensions only, with --rope (Pythia: a quarter; "
             "Phi-2: 32 of 80); even, 2..d_head.")] = None,
    precision: Precision = 3,
    opts: Options = None,
):
    """The sinusoidal positional-encoding matrix as a heatmap, each column sin/cos + wavelength.

    Example: tfm pe --len 16 --d-model 8
    """
    from tfmcli.engine.positional import sinusoidal, wavelengths
    from tfmcli.io import jsonable

    if length * d_model > 20_000_000:
        raise typer.BadParameter(f"{length} x {d_model} is {length * d_model:,} values; at most "
                                 f"20,000,000", param_hint="'--len' / '--d-model'")
    for name, what in (("rope_theta", "RoPE's base"), ("rope_scaling", "RoPE's scaling"),
                       ("rotary_dim", "how many dimensions RoPE turns")):
        if opts.explicit(name) and not rope:
            raise typer.BadParameter(f"it sets {what}; add --rope",
                                     param_hint=f"'--{name.replace('_', '-')}'")
    if opts.explicit("heads") and not alibi:
        raise typer.BadParameter("it sets ALiBi's heads; add --alibi", param_hint="'--heads'")
    if alibi:
        if rope:
            raise typer.BadParameter("--rope and --alibi are two encodings; give one",
                                     param_hint="'--alibi'")
        if opts.explicit("d_model"):
            raise typer.BadParameter("ALiBi has no width: it adds one number per query and "
                                     "key; give --heads", param_hint="'--d-model'")
        if length > MAX_ROPE_LEN:
            raise typer.BadParameter(f"{length} positions make a {length} x {length} map; "
                                     f"with --alibi at most {MAX_ROPE_LEN:,}",
                                     param_hint="'--len'")
        alibi_view(opts, length, heads, precision)
        return
    if rope:
        if not (math.isfinite(rope_theta) and rope_theta > 0):
            raise typer.BadParameter(f"{rope_theta} is not allowed (allowed: a finite number "
                                     f"> 0)", param_hint="'--rope-theta'")
        if rotary_dim is not None and not (rotary_dim % 2 == 0 and 2 <= rotary_dim <= d_model):
            raise typer.BadParameter(f"{rotary_dim} is not allowed (allowed: an even number "
                                     f"from 2 to the head's {d_model}: RoPE turns pairs)",
                                     param_hint="'--rotary-dim'")
        rope_view(opts, length, d_model, precision, rope_theta, _scaling(rope_scaling),
                  rotary_dim)
        return
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
    from tfmcli.render.heatmap import shows_values

    in_cells = 2 * d_model + 8 <= width() and shows_values(
        matrix, row_labels=rows, col_labels=[str(j) for j in range(d_model)], width=width(),
        precision=precision, diverging=True)
    if length * d_model <= 256 and not in_cells:   # the numbers, unless the map wrote them
        parts.append(
            render.tensor_table(
                matrix,
                title="values",
                precision=precision,
                row_labels=rows,
                col_labels=col_labels,
                width=width(),
            )
        )
    emit(opts, parts, {"pe": jsonable(matrix)}, {"pe": matrix})


def _scaling(text):
    """--rope-scaling's four numbers as a config.RopeScaling, its one a
    config.LinearRopeScaling, or None."""
    from tfmcli.cli.options import parse_rope_scaling
    from tfmcli.engine.config import RopeScaling
    from tfmcli.errors import ConfigError

    values = parse_rope_scaling(text)
    try:
        return None if values is None else RopeScaling.parse(values)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="'--rope-scaling'") from None


MAX_ROPE_LEN = 4_000   # the score map is len x len: 16 million values at most


def rope_view(opts, length, d_head, precision, base=10000.0, scaling=None, rotary_dim=None):
    """tfm pe --rope: the cosine and sine of each pair's angle at each position, and the score
    of u = (1, ..., 1) / sqrt(d_head) turned at t against itself turned at s; with ``scaling``
    (LLaMA 3.1's, or linear), which pairs it slows and by how much; with ``rotary_dim``, the
    pairs of the first ``rotary_dim`` dimensions, the rest left as they are."""
    import numpy as np

    from tfmcli.engine.positional import (
        rope_angles,
        rope_scale,
        rope_scores,
        rope_tables,
        wavelengths,
    )
    from tfmcli.io import jsonable

    if d_head < 2:
        raise typer.BadParameter(f"{d_head} is a head of one dimension, which RoPE leaves "
                                 f"unturned; at least 2", param_hint="'--d-model'")
    if length > MAX_ROPE_LEN:
        raise typer.BadParameter(f"{length} positions make a {length} x {length} score map; with "
                                 f"--rope at most {MAX_ROPE_LEN:,}", param_hint="'--len'")
    turned = rotary_dim or d_head   # an odd head's last dimension is left unturned
    angles = rope_angles(length, turned, base, scaling)                   # (T, m)
    m = turned // 2
    still = d_head - 2 * m                                                # dimensions unturned
    cos, sin = rope_tables(length, turned, base=base, scaling=scaling)
    score = rope_scores(length, d_head, base, scaling, turned)            # (T, T)
    rows = [f"p{p}" for p in range(length)]
    pairs = [f"({i},{i + m})" for i in range(m)]
    scale = np.ones(m) if scaling is None else rope_scale(turned, base, scaling)
    waves = wavelengths(2 * m, base)[0::2] / scale                        # one per pair
    s_i = "" if scaling is None else "s_i "
    parts = [Text(f"RoPE: pair i of a head, dimensions (i, i + {m}), turns by {s_i}t / "
                  f"{base:g}^(2i/{2 * m}) at position t: q_rot = q cos + rotate_half(q) sin"
                  + (f"; dimension {d_head - 1} is not turned" if still == 1 else
                     f"; dimensions {2 * m}-{d_head - 1} are not turned" if still else ""),
                  style="bold")]
    if scaling is not None:
        parts.append(Text(scaling_note(scaling, scale)))
    for name, table in (("cos", np.cos(angles)), ("sin", np.sin(angles))):
        parts.append(render.heatmap(table, title=f"{name} of each pair's angle ({length} "
                                                 f"positions x {m} pairs)",
                                    row_labels=rows, col_labels=pairs, width=width(),
                                    vmin=-1.0, vmax=1.0, diverging=True, precision=precision))
    parts.append(Text(f"pair (0,{m}) turns once every {waves[0]:.3g} positions, pair "
                      f"({m - 1},{2 * m - 1}) once every {waves[-1]:.3g}", style="dim"))
    parts.append(render.heatmap(score, title="u_rot(t) . u_rot(s), u = (1, ..., 1) / "
                                             "sqrt(d_head): the same along every diagonal",
                                row_labels=rows, col_labels=[f"s{s}" for s in range(length)],
                                width=width(), vmin=-1.0, vmax=1.0, diverging=True,
                                precision=precision))
    offsets = [score[t, 0] for t in range(length)]
    spread = max(float(np.abs(np.diagonal(score, -k) - offsets[k]).max())
                 for k in range(length))
    parts.append(Text(f"a score depends on t - s only: along each diagonal it varies by at "
                      f"most {spread:.1e}; it is Σ_i 2 cos({s_i}(t - s) / {base:g}^(2i/{2 * m})) / "
                      f"{d_head}" + (f" + {still}/{d_head} (the unturned dimension"
                                     f"{'s' * (still > 1)})" if still else "")
                      + f": 1 at t = s, {offsets[-1]:+.3f} at t - s = {length - 1}",
                      style="dim"))
    arrays = {"angles": angles, "cos": cos, "sin": sin, "score": score}
    if scaling is not None:
        arrays["scale"] = scale
    emit(opts, parts, {name: jsonable(a) for name, a in arrays.items()}, arrays)


def scaling_note(scaling, scale) -> str:
    """Which pairs LLaMA 3.1's scaling keeps, slows and blends, from each pair's ``scale``
    (``positional.rope_scale``); linear scaling slows every one alike."""
    import numpy as np

    if len(scaling) == 1:
        return (f"s_i = 1/{scaling[0]:g} for every pair: linear scaling (position "
                f"interpolation), position t turns as t / {scaling[0]:g} did")
    factor, low, high, context = scaling
    kept, slowed = scale == 1, scale == 1 / factor
    between = ~kept & ~slowed

    def pairs(chosen):
        index = np.flatnonzero(chosen)
        if len(index) == 0:
            return "no pair"
        return f"pair {index[0]}" if len(index) == 1 else f"pairs {index[0]}-{index[-1]}"

    note = (f"s_i, LLaMA 3.1's scaling (factor {factor:g}, low_freq_factor {low:g}, "
            f"high_freq_factor {high:g}, context C = {context}): kept (s_i = 1) for "
            f"{pairs(kept)}, wavelength under C / {high:g} = {context / high:g} positions; "
            f"slowed {factor:g} times (s_i = 1/{factor:g}) for {pairs(slowed)}, over C / "
            f"{low:g} = {context / low:g}; blended for {pairs(between)}, between")
    if between.any():
        note += " (s_i " + ", ".join(f"{x:.3g}" for x in scale[between][:4]) + (
            ", ..." if between.sum() > 4 else "") + ")"
    return note


def alibi_view(opts, length, heads, precision):
    """tfm pe --alibi: each head's slope m, and the bias -m (i - j) the steepest and the
    gentlest head add to their causal scores (keys ahead, which the mask hides, as "·")."""
    import numpy as np

    from tfmcli.engine.positional import alibi_bias, alibi_slopes, slope_name
    from tfmcli.io import jsonable

    slopes = alibi_slopes(heads)
    bias = alibi_bias(length, heads)                                      # (H, T, T)
    causal = np.tril(np.ones((length, length), dtype=bool))
    rows = [f"q{i}" for i in range(length)]
    keys = [f"k{j}" for j in range(length)]
    power = 2 ** int(np.floor(np.log2(heads)))
    parts = [Text("ALiBi: head h adds -m_h (i - j) to its scaled score of query i at key j, "
                  "before the mask: nothing at the query itself, less the further behind the "
                  "key", style="bold"),
             Text(f"slopes: 2^(-8k/{power}) for heads 0-{power - 1} (k = 1..{power})"
                  + (f", then every other slope of {2 * power} heads' sequence, "
                     f"2^(-4(2k-1)/{power}), for heads {power}-{heads - 1}"
                     if heads > power else "")),
             render.record_table(["head", "slope m", "value", "at distance 10"],
                                 [[str(h), slope_name(m), f"{m:.6g}",
                                   render.fmt(-10 * m, precision)]
                                  for h, m in enumerate(slopes)])]
    shown = (0,) if heads == 1 else (0, int(np.argmin(slopes)))
    lowest = float(bias[list(shown)][:, causal].min())   # one scale: the gentle head looks flat
    for h in shown:
        parts.append(render.heatmap(bias[h], title=f"head {h}'s bias, m = "
                                                   f"{slope_name(slopes[h])} (· = a key ahead, "
                                                   f"hidden by the causal mask)",
                                    row_labels=rows, col_labels=keys, mask=causal,
                                    width=width(), vmin=lowest, vmax=0.0,
                                    precision=precision))
    parts.append(Text("both maps on one scale; a constant added to a whole row leaves its "
                      "softmax as it is: BLOOM adds m j and MPT m (j - T + 1), which attend "
                      "alike", style="dim"))
    arrays = {"slopes": slopes, "bias": bias}
    emit(opts, parts, {name: jsonable(a) for name, a in arrays.items()}, arrays)
