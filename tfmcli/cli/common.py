"""What every command shares: the console, printing or saving the result, building the run,
and checking the options that name a row, head, block or tensor of it."""

import io
import math
import os
from contextlib import contextmanager
from enum import Enum
from typing import Annotated, List, Optional

import numpy as np
import typer
from rich.console import Console

import tfmcli
from tfmcli import render
from tfmcli.cli.options import Options, bounded, check_name, check_range, from_options
from tfmcli.cli.screen import floored
from tfmcli.engine import sizes
from tfmcli.errors import ConfigError, TfmError

Precision = Annotated[
    int,
    typer.Option("--precision", callback=bounded(0, 12), help="Digits after the point (0..12)."),
]
Row = Annotated[int, typer.Option("--row", callback=bounded(0), help="Batch row to show.")]
WHOLE = 32   # the by-hand views (ln, ffn, loss) show a row up to this many columns whole, wrapped
Position = Annotated[
    int, typer.Option("--position", "-t", callback=bounded(0), help="Position (token) of the row.")
]
Show = Annotated[
    Optional[List[str]],
    typer.Option("--show", metavar="NAME", help="Print this tensor in full (repeatable)."),
]
Full = Annotated[bool, typer.Option("--full", help="Every row, none elided.")]
WideRows = Annotated[bool, typer.Option("--full", help="Every column (else up to 32).")]
MAX_ROWS = 40  # table rows shown without --full: one screenful
# Adam's learning rate, for tfm train and tfm adam: seed 004's warm-up schedule, or a constant
Warmup = Annotated[
    int, typer.Option("--warmup", callback=bounded(1), help="Warm-up steps of the schedule.")
]
Rate = Annotated[Optional[float], typer.Option("--lr", help="A constant rate, not the schedule.")]


def check_rate(opts: Options, lr):
    """--lr must be a positive number, and replaces the schedule that --warmup shapes."""
    if lr is not None and not (np.isfinite(lr) and lr > 0):
        raise typer.BadParameter(f"{lr} is not allowed (allowed: a positive number)",
                                 param_hint="'--lr'")
    if lr is not None and opts.explicit("warmup"):
        raise typer.BadParameter("a constant --lr replaces the warm-up schedule; give one of "
                                 "--lr and --warmup", param_hint="'--warmup'")


def rows_limit(full: bool):
    return None if full else MAX_ROWS



def make_console(**kwargs) -> Console:
    """The console everything prints to: no escape codes at all when NO_COLOR is set. Strings
    are printed as they are, never read as rich's markup: a token or a path may be '[/quote]'.
    Never narrower than the narrowest view tfm lays out (``screen.MIN_WIDTH``)."""
    plain = bool(os.environ.get("NO_COLOR"))
    return floored(Console(highlight=False, emoji=False, markup=False,
                           color_system=None if plain else "auto", **kwargs))


def width() -> int:
    return make_console().width


PIPED_HEIGHT = 50   # "a screenful" when the output is not a terminal


def height() -> int:
    """Lines of the terminal ($LINES if set), or PIPED_HEIGHT when stdout is not one."""
    console = make_console()
    return console.height if console.is_terminal or os.environ.get("LINES") else PIPED_HEIGHT


def emit(opts: Options, renderables, payload, arrays=None):
    """Print, then save: JSON when --json, else the renderables (recorded for --svg); then
    --save's and --svg's files, both or neither (``io.save_outputs``).

    ``payload`` and ``renderables`` may be functions that return them, so that what only JSON
    needs (statistics of every activation, say) is computed only for --json, and the view
    only without it: nothing is computed twice, nothing for what is not shown."""
    from tfmcli.io import save_outputs

    npz = opts.values.get("save") if arrays is not None else None
    if opts.saving is not None:   # a streamed run's: written as it went, finished here
        opts.saving.close(arrays)
        npz = None
    console = make_console()
    if opts.json:   # through the console: a closed pipe then ends the run like any output
        import json  # here, not at the top: a command without --json starts sooner

        payload = payload() if callable(payload) else payload
        if opts.made is not None and isinstance(payload, dict) and "inputs" not in payload:
            payload = {**payload, "inputs": inputs_json(opts.made)}
        if opts.made is not None and opts.made.interventions and isinstance(payload, dict):
            payload = {**payload, "interventions": opts.made.interventions}
        console.out(json.dumps(payload), highlight=False)
        save_outputs(npz, arrays)
        return
    if callable(renderables):
        renderables = renderables()
    from tfmcli.render.wrap import wrapped  # prose and formulas break between clauses

    renderables = [wrapped(item) for item in renderables]
    for item in renderables:
        console.print(item)
    if opts.svg is not None:   # in colour, as a terminal would show it, whatever stdout is
        recorder = Console(record=True, file=io.StringIO(), width=console.width,
                           force_terminal=True, color_system="truecolor", highlight=False,
                           emoji=False, markup=False)
        for item in renderables:
            recorder.print(item)
    save_outputs(npz, arrays, opts.svg, None if opts.svg is None else svg(recorder))


def inputs_json(run) -> dict:
    """What a run ran on, for --json: its tokens, targets (-100: none) and lengths, and where
    they and the weights came from."""
    inputs = run.inputs
    return {"tokens": inputs.tokens.tolist(), "targets": inputs.targets.tolist(),
            "lengths": inputs.lengths.tolist(), "tokens_from": run.tokens_from,
            "weights_from": run.weights_from, "arch": run.arch}


def svg(recorder: Console) -> str:
    """What ``recorder`` printed, as Rich's SVG, with its spaces kept (``xml:space``): without
    it librsvg collapses runs of spaces, which shifts right-aligned columns."""
    return recorder.export_svg(title="tfm").replace(
        '<svg class="rich-terminal"', '<svg class="rich-terminal" xml:space="preserve"', 1)


def _alibi_notes(cfg) -> str:
    """' (slopes 1/16, 1/256)': ALiBi's slope of each head, the first two and the last past
    four heads."""
    if cfg.pe != "alibi":
        return ""
    from tfmcli.engine.positional import alibi_slopes, slope_name

    names = [slope_name(m) for m in alibi_slopes(cfg.heads)]
    return f" (slopes {', '.join(names if len(names) <= 4 else names[:2] + ['…', names[-1]])})"


def _rope_notes(cfg) -> str:
    """' (theta 500000, llama3 scaling 32,1,4,8192)': what RoPE turns by, when not its own;
    with a base of the sliding blocks' own, ' (full blocks: theta 1e+06, linear scaling 8;
    sliding blocks: theta 10000)'; with ``rotary_dim``, which of a head's dimensions it turns
    (' (the first 16 of each head's 64 dimensions)')."""
    if cfg.pe != "rope":
        return ""
    notes = []
    if cfg.rope_theta != 10000 or cfg.rope_local_theta is not None:
        notes.append(f"theta {cfg.rope_theta:g}")
    if cfg.rope_scaling is not None:
        notes.append(scaling_name(cfg.rope_scaling))
    if cfg.rope_local_theta is not None:
        notes = [f"full blocks: {', '.join(notes)}; sliding blocks: theta "
                 f"{cfg.rope_local_theta:g}"]
    if cfg.rotary_dim is not None and cfg.rotary_dim < cfg.d_head:
        notes.append(f"the first {cfg.rotary_dim} of each head's {cfg.d_head} dimensions")
    return f" ({'; '.join(notes) if cfg.rope_local_theta is not None else ', '.join(notes)})" \
        if notes else ""


def scaling_name(scaling) -> str:
    """'llama3 scaling 32,1,4,8192' or 'linear scaling 8': a Config.rope_scaling, named."""
    kind = "linear" if len(scaling) == 1 else "llama3"
    return f"{kind} scaling " + ",".join(f"{x:g}" for x in scaling)


def _biases(cfg) -> str:
    """The panel's biases row of a model without ``--bias``: which layers still add theirs."""
    ffn = "b_gate, b_1, b_2" if cfg.gated else "b_1, b_2"
    if cfg.qkv_bias and cfg.ffn_bias:
        return f"Q, K, V and FFN only (b_Q, b_K, b_V, {ffn})"
    if cfg.qkv_bias:
        return "Q, K and V only (b_Q, b_K, b_V)"
    return f"FFN only ({ffn})" if cfg.ffn_bias else "none in attention and FFN"


def _after(rows: dict, key: str, new_key: str, value: str):
    """The rows with (new_key, value) put right after ``key``."""
    for name, text in rows.items():
        yield name, text
        if name == key:
            yield new_key, value


def describe(cfg, run=None, row: int = 0, arch: str | None = None) -> dict:
    """The config panel's rows; with a run, where its weights and tokens came from, and the
    tokens and targets of batch row ``row``. ``arch``: the --arch preset (a run knows its own)."""
    sliding = "" if cfg.sliding_layers is None else (
        f" in block{'s' * (len(cfg.sliding_layers) != 1)} "
        f"{', '.join(map(str, cfg.sliding_layers)) or 'none'}")
    mask = ("causal" if cfg.causal else "none") + (
        f", sliding window {cfg.sliding_window}{sliding}" if cfg.sliding_window is not None
        else "") + (
        f" + padding {list(cfg.lengths)}" if cfg.lengths is not None else "")
    rows = {
        "sizes": (f"B={cfg.batch} T={cfg.seq_len} d={cfg.d_model} H={cfg.heads} "
                  + (f"H_kv={cfg.h_kv} " if cfg.group > 1 else "")   # grouped keys and values
                  + f"d_head={cfg.d_head} d_ff={cfg.ff} V={cfg.vocab} L={cfg.layers}"),
        "norm": ("Pre-LN (+ final ln_f)" if cfg.norm == "pre" else "Post-LN") + (
            ", sandwich (ln1_post, ln2_post on each sublayer's output)" if cfg.sandwich_norm
            else ", parallel, one norm (both read LN1(x))" if cfg.shared_norm
            else ", parallel (both sublayers read x)" if cfg.parallel_residual
            else "") + (", RMSNorm (no mean, no beta)" if cfg.rms_norm
                        else ", layer norm without beta (gamma only)" if not cfg.norm_bias
                        else ""),
        "activation": cfg.activation + {"gelu": " (tanh approx.)",
                                         "gelu_erf": " (exact: 0.5 x (1 + erf(x / sqrt 2)))",
                                         "swiglu": " (silu(gate) * pre)",
                                         "geglu": " (gelu(gate) * pre, tanh approx.)",
                                         "geglu_erf": " (gelu_erf(gate) * pre, GELU itself)"}.get(
            cfg.activation, ""),
        "mask": mask,
        "positional": cfg.pe + (f" (n_ctx {cfg.ctx})" if cfg.pe == "learned" else "")
        + _rope_notes(cfg) + _alibi_notes(cfg),
        "init": cfg.init,
        "dtype": cfg.dtype,
        "eps": f"{cfg.eps:g}",
        "seed": str(cfg.seed),
        "parameters": f"{sizes.param_count(cfg):,}",
    }
    arch = run.arch if run is not None else arch
    if arch is not None:   # the preset first: the rows below are what it set
        from tfmcli.engine.presets import PRESETS

        rows = {"arch": f"{arch} (the architecture of {PRESETS[arch].family})", **rows}
    if cfg.qk_norm:   # after the norm row
        rows = dict(_after(rows, "norm", "q, k norm",
                           "each head's, before the scores (attn.q_norm, attn.k_norm)"))
    if cfg.embed_scale:   # after the positions
        rows = dict(_after(rows, "positional", "embed scale",
                           f"x sqrt(d) = {cfg.embed_factor:.6g} (embed = sqrt(d) W_E[id])"))
    if cfg.embed_norm:   # BLOOM's
        rows = dict(_after(rows, "positional", "embed norm",
                           ("RMSNorm" if cfg.rms_norm else "layer norm")
                           + " of W_E[id] before block 0 (ln_embed)"))
    if cfg.attn_softcap is not None:   # after the mask
        c = f"{cfg.attn_softcap:g}"
        rows = dict(_after(rows, "mask", "score cap", f"{c} tanh(s / {c}), before the mask"))
    if cfg.attn_scale is not None:   # after the mask, before the cap
        rows = dict(_after(rows, "mask", "score scale",
                           f"q . k x {cfg.attn_scale:.6g} (not 1/sqrt(d_head) = "
                           f"{1 / cfg.d_head ** 0.5:.6g})"))
    if not cfg.bias:
        rows["biases"] = _biases(cfg)
    if cfg.tied_head or not cfg.head_bias:
        rows["head"] = ("h W_E^T (tied to the embedding)" if cfg.tied_head else "h W_U") + (
            " + b_U" if cfg.head_bias else ", no bias")
    if cfg.logit_softcap is not None:
        c = f"{cfg.logit_softcap:g}"
        rows["logit cap"] = f"{c} tanh(z / {c}) of the head's z"
    if run is not None:
        del rows["init"], rows["seed"]
        rows["weights"] = run.weights_from
        rows["tokens from"] = run.tokens_from
        if run.task is not None:   # a model tfm train saved: which positions the loss scores
            rows["scored"] = run.scored
        if run.streamed:   # held a block at a time, and why (choose_stream)
            rows["streamed"] = run.streamed
        if run.interventions:   # what was changed, in the order it was applied
            rows["interventions"] = "; ".join(run.interventions)
        rows[f"row {row} tokens"] = render.token_line(run.token_labels(row))
        rows[f"row {row} targets"] = render.token_line(run.target_labels(row))
        if run.tokens_from == f"seed {cfg.seed}":   # make_inputs: T + 1 ids, shifted by one
            drawn = [*map(str, run.inputs.tokens[row]), str(run.inputs.targets[row, -1])]
            rows[f"row {row} drawn"] = (f"{render.token_line(drawn)}  (T + 1 ids: the tokens, "
                                        f"then the last target)")
    return rows


def execute(opts: Options, with_grads: bool, validate=None, intervene: bool = True,
            also: str = "", keep=None, held=None,
            whole: str = "reads every activation and gradient of the run, so it holds them all"):
    """Build the run the options describe; forward (and backward). Refuses NaN/Inf results.

    ``validate(cfg)`` checks the command's own options once the config is known, before
    anything is computed. ``intervene=False``: the run as it is, the command making the
    interventions itself (tfm kv, on its one row). ``also``: the command's other way out
    of a run too big for the memory. Returns ``(run, fwd, grads)`` (``grads`` None without
    ``with_grads``).

    A command that can run streamed, a block at a time (``--stream``, or by itself when only
    that fits: ``choose_stream``), says which activations it reads as arrays, ``keep(run)``,
    and which parameters' gradients, ``held(run)``; every other one is summarised as it is made
    (``explain.summary.Summary``, which the tables read as they read an array), written to
    ``--save`` as it goes (``io.NpzStream``) and dropped. ``keep`` None: it cannot stream,
    and ``whole`` says why.
    """
    from tfmcli.cli.streaming import choose_stream, streamed_sink
    from tfmcli.engine.memory import keep_freed_memory
    from tfmcli.engine.model import first_nonfinite

    keep_freed_memory()   # large arrays reuse freed memory: no page faults after the first
    run = opts.run()
    cfg = run.cfg
    if validate is not None:
        validate(cfg)
    streaming = choose_stream(opts, run, keep, held, also, why=whole)
    estimate, kept, holding = streaming or (None, None, None)   # (None: the whole run)
    if streaming and run.lazy_params is not None:   # the weights stay in their files
        run.params = run.lazy_params()
    try:
        with np.errstate(over="raise"):   # a weight past the dtype's range, as it is cast
            params, inputs = run.complete().params, run.inputs
    except FloatingPointError as e:
        raise overflowed(cfg, e) from None
    seen = streamed_sink(opts, run) if streaming else None
    try:
        # An overflow anywhere makes every later number meaningless (a layer norm of values
        # whose square overflows returns 0, not the right answer), so it stops the run.
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"), \
                blocks_bar(cfg, estimate, with_grads) as (forward_tick, backward_tick):
            changes = interventions(opts, run) if intervene else []
            fwd = forward_changed(opts, params, inputs, cfg, changes, keep=kept, seen=seen,
                                  progress=forward_tick)
            grads = None if not with_grads else tfmcli.backward(
                params, fwd, cfg, keep=holding, seen=seen, progress=backward_tick)
    except FloatingPointError as e:
        raise overflowed(cfg, e) from None
    bad = first_nonfinite(fwd.acts) or (with_grads and (first_nonfinite(grads)
                                                        or first_nonfinite(grads.acts)))
    if bad or not math.isfinite(fwd.loss):
        raise TfmError(f"the run produced NaN or Inf (first in {bad or 'the loss'}); "
                       f"try smaller weights (--init normal) or --dtype float64")
    return run, fwd, grads


def overflowed(cfg, error: FloatingPointError) -> TfmError:
    """The one line a run that overflowed its dtype ends with (``error``: NumPy's words)."""
    hint = {"float32": " or --dtype float64",
            "float16": (" or --dtype float32 (float16's largest number is 65504; tfm "
                        "precision --dtype float16 counts each tensor's overflows)"),
            }.get(cfg.dtype, "")
    return TfmError(f"the run overflowed {cfg.dtype} ({error}): values too large to be right; "
                    f"use smaller weights or inputs{hint}")


def interventions(opts: Options, run) -> list[tuple[str, object]]:
    """The interventions the options ask for, each with the option that asked: --patch's
    (from the run on --from-tokens or --from-text), then --ablate's, --set's, --scale's, each
    in the order typed. The run's panel and --json list them (``run.interventions``)."""
    from tfmcli.engine.interventions import Ablate, Patch, Scale, Set

    values = opts.values
    if "patch" not in values:   # a command without interventions (tfm patch: its own runs)
        return []
    patch, ablate = values.get("patch") or [], values.get("ablate") or []
    source_given = values.get("from_tokens") or values.get("from_text")
    if patch and not source_given:
        raise typer.BadParameter("a patch copies from another run: add --from-tokens IDS or "
                                 "--from-text TEXT", param_hint="'--patch'")
    if source_given and not patch and not opts.own_corrupted:
        flag = "--from-tokens" if values.get("from_tokens") else "--from-text"
        raise typer.BadParameter("it gives the run --patch copies from; add --patch TARGET",
                                 param_hint=f"'{flag}'")
    changes = []
    if patch:
        source = patch_source(opts, run)
        changes += [("--patch", Patch(target, source)) for target in patch]
    using = values.get("ablate_with")
    using = getattr(using, "value", using) or "zero"
    changes += [("--ablate", Ablate(target, using)) for target in ablate]
    for flag, kind in (("--set", Set), ("--scale", Scale)):
        for text in values.get(flag[2:]) or []:
            target, _, number = text.rpartition("=")
            try:
                value = float(number)
            except ValueError:
                value = None
            if not target.strip() or value is None or not math.isfinite(value):
                what = "VALUE" if kind is Set else "FACTOR"
                raise typer.BadParameter(f"{text!r} is not TARGET={what} with a finite number "
                                         f"(like blocks.0.ffn.act[:, 3]=0.5)",
                                         param_hint=f"'{flag}'")
            changes.append((flag, kind(target.strip(), value)))
    run.interventions = [change.describe() for _, change in changes]
    return changes


def patch_source(opts: Options, run):
    """The run --patch copies from: the same model on --from-tokens or --from-text."""
    from dataclasses import replace

    from tfmcli.sources import parse_tokens

    values = opts.values
    if values.get("from_tokens") and values.get("from_text"):
        raise typer.BadParameter("give the other run as --from-tokens or as --from-text, not "
                                 "both", param_hint="'--from-text'")
    if values.get("from_text"):
        if run.encode is None:
            raise typer.BadParameter("tfm cannot tokenize text here: it needs --load DIR, a "
                                     "checkpoint folder with a tokenizer; --from-tokens takes "
                                     "ids", param_hint="'--from-text'")
        rows, flag = [run.encode(text) for text in values["from_text"]], "--from-text"
    else:
        try:
            rows = parse_tokens(values["from_tokens"], "from_tokens")
        except ConfigError as e:
            raise typer.BadParameter(str(e), param_hint="'--from-tokens'") from None
        flag = "--from-tokens"
    if not all(rows):
        raise typer.BadParameter("a row with no tokens", param_hint=f"'{flag}'")
    inputs = tfmcli.inputs_from_tokens(rows)
    B, T = inputs.tokens.shape
    bad = inputs.tokens[(inputs.tokens < 0) | (inputs.tokens >= run.cfg.vocab)]
    if bad.size:
        raise typer.BadParameter(f"id {int(bad[0])} is outside 0..{run.cfg.vocab - 1}",
                                 param_hint=f"'{flag}'")
    try:
        cfg = replace(run.cfg, batch=B, seq_len=T, lengths=None if all(
            inputs.lengths == T) else tuple(int(n) for n in inputs.lengths))
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint=f"'{flag}'") from None
    return tfmcli.forward(run.params, inputs, cfg)


def forward_changed(opts: Options, params, inputs, cfg, changes, keep=None, seen=None,
                    progress=None):
    """The forward pass with ``changes`` (``interventions``; ``keep``: streamed, as
    ``forward`` takes it); a target that does not fit this model is a usage error naming the
    option and the target."""
    from tfmcli.engine.interventions import InterventionError

    try:
        return tfmcli.forward(params, inputs, cfg, interventions=[c for _, c in changes],
                              keep=keep, seen=seen, progress=progress)
    except InterventionError as e:
        raise target_error(e, changes) from None


def target_error(error, changes, note: str = "") -> typer.BadParameter:
    """An ``InterventionError`` as a usage error naming the option its target came from
    (``changes``: ``interventions``' pairs)."""
    flag = next((flag for flag, c in changes if c.target == error.target), "--ablate")
    return typer.BadParameter(f"{error}{note}", param_hint=f"'{flag}'")


def token_id(run, value, flag):
    """--answer / --wrong: an id in the vocabulary, or text that is one token."""
    if value is None:
        return None
    if value.lstrip("-").isdigit():
        token = int(value)
    elif run.encode is None:
        raise typer.BadParameter(f"{value!r} is not a token id (text needs --load DIR's "
                                 f"tokenizer)", param_hint=f"'{flag}'")
    else:
        ids = run.encode(value)
        if len(ids) != 1:
            raise typer.BadParameter(f"{value!r} is {len(ids)} tokens; give one token",
                                     param_hint=f"'{flag}'")
        token = ids[0]
    if not 0 <= token < run.cfg.vocab:
        raise typer.BadParameter(f"{token} is outside 0..{run.cfg.vocab - 1}",
                                 param_hint=f"'{flag}'")
    return token


@contextmanager
def progress_bar(what: str):
    """A progress bar on stderr when it is a terminal (``tick(done, total)``), else nothing."""
    from rich.console import Console

    console = floored(Console(stderr=True))
    if not console.is_terminal:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(what, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


SLOW_FLOPS = 10 ** 11   # from here a run takes seconds (two cores, float64: 20-50 GFLOP/s)


@contextmanager
def blocks_bar(cfg, estimate: int | None, with_grads: bool):
    """The run's progress bar, a block at a time, forward then backward (on a terminal): a
    streamed run's (its label gives the ``estimate``, in bytes, before any work) or a whole
    run's that takes seconds (``SLOW_FLOPS``). Yields the forward's and the backward's
    ``progress`` (``model.forward``'s), or Nones."""
    forward_flops, backward_flops = sizes.flops(cfg)
    if estimate is None and forward_flops + with_grads * backward_flops < SLOW_FLOPS:
        yield None, None
        return
    from tfmcli.cli.options import binary_size

    label = ("the whole run" if estimate is None else
             f"a block at a time, about {binary_size(estimate)}") + (
        ": forward then backward" if with_grads else "")
    with progress_bar(label) as tick:
        if tick is None:
            yield None, None
            return
        total = cfg.layers * (1 + with_grads)
        yield (lambda done, _: tick(done, total),
               lambda done, _: tick(cfg.layers + done, total))


def position_labels(run, row: int, prefix: str = "") -> list[str]:
    """'0:3', '1:1', ... (or 'q0:3' with a prefix): each position with its token."""
    return [f"{prefix}{t}:{label}" for t, label in enumerate(run.token_labels(row))]


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


def check_show(cfg, names, gradient=False) -> set:
    """Every --show NAME must be an activation or a parameter of this config; returns their
    full names (what a streamed run keeps whole)."""
    known = [*sizes.activation_shapes(cfg), *sizes.param_shapes(cfg)]
    return {check_name(name, known, gradient=gradient) for name in names or []}


def show_tensors(tensors: dict, names, precision, row, head, run, gradient=False):
    """Renderables and JSON for each --show NAME (already checked), cut by --row/--head.

    Rows of an activation are positions, labelled with their tokens; a (T, T) attention tensor
    labels queries and keys and shows the cells its mask hides as ``·``. With ``gradient``,
    ``tensors`` are gradients, shown and keyed as 'd' + name.
    """
    from tfmcli.engine.model import block_masks
    from tfmcli.io import jsonable

    prefix = "d" if gradient else ""
    cfg = run.cfg
    activations = sizes.activation_shapes(cfg)
    masks = block_masks(cfg, run.inputs.lengths, cfg.seq_len, row)   # each block's
    shown, payload = [], {}
    for raw in names or []:
        name = check_name(raw, tensors, gradient=gradient)
        value = tensors[name]
        cut, caption = sliced(prefix + name, value, row, head)
        labels = {}
        if name.endswith(("attn.scores", "attn.pattern")):
            labels = dict(row_labels=position_labels(run, row, "q"),
                          col_labels=position_labels(run, row, "k"),
                          mask=masks[int(name.split(".")[1])])
        elif name in activations and value.ndim >= 3:   # (B, T, ...) or (B, H, T, d_head)
            labels = dict(row_labels=position_labels(run, row))
        shown.append(render.tensor_table(cut, title=caption, precision=precision, full=True,
                                         width=width(), **labels))
        payload[prefix + name] = {"shape": list(value.shape), "values": jsonable(value)}
    return shown, payload


# ---------------------------------------------------------------- a clean and a corrupted run
# (tfm patch's, tfm circuit's, tfm explore's; here, not in cli/patch.py, whose command's
# decorator imports every command module: importing it from another reorders --help)

# the corrupted run: these commands' own options (every other command hides them)
FROM_OPTIONS = from_options(panel=None)


class Metric(str, Enum):
    loss = "loss"
    logit_diff = "logit-diff"


# the metric of a clean and a corrupted run
MetricOption = Annotated[Metric, typer.Option(
    "--metric", case_sensitive=False, metavar="METRIC", show_default=False,
    help="loss (the default), or logit-diff: --answer's minus --wrong's.")]
AnswerOption = Annotated[Optional[str], typer.Option(
    "--answer", metavar="ID|TEXT", help="logit-diff's right next token.")]
WrongOption = Annotated[Optional[str], typer.Option(
    "--wrong", metavar="ID|TEXT", help="logit-diff's wrong next token.")]
# a circuit's method (tfm circuit's, tfm explore's)
StepsOption = Annotated[int, typer.Option(
    "--steps", min=0, max=1000, metavar="N",
    help="EAP-IG over N points from clean to corrupted (0: EAP).")]


def check_metric(metric, answer, wrong) -> None:
    """A logit difference needs --answer and --wrong: a usage error without them."""
    if metric == Metric.logit_diff and (answer is None or wrong is None):
        raise typer.BadParameter("a logit difference needs --answer and --wrong (ids, or text "
                                 "with --load DIR)", param_hint="'--metric'")


def metric_ids(run, answer, wrong) -> list:
    """--answer's and --wrong's token ids (None where not given)."""
    return [token_id(run, value, flag) for value, flag in ((answer, "--answer"),
                                                          (wrong, "--wrong"))]


@contextmanager
def circuit_errors(hint: str = "'--from-tokens'"):
    """``explain.circuit``'s refusals as usage errors: a corrupted run that does not pair
    with the clean one (naming ``hint``), a Post-LN model (naming --norm)."""
    from tfmcli.engine.interventions import InterventionError
    from tfmcli.errors import TfmError

    try:
        yield
    except InterventionError as e:
        raise typer.BadParameter(str(e), param_hint=hint) from None
    except TfmError as e:
        if "Post-LN" in str(e):
            raise typer.BadParameter(str(e), param_hint="'--norm'") from None
        raise


def circuit_of(opts: Options, run, metric: Metric, ids, steps: int = 0, progress=None):
    """The circuit (``explain.circuit.circuit``) of the run and the corrupted one
    --from-tokens or --from-text gives: tfm circuit's, and tfm explore's."""
    from tfmcli.explain.circuit import circuit

    corrupted = patch_source(opts, run).inputs
    with circuit_errors():
        return circuit(run.params, run.inputs, corrupted, run.cfg, metric.value, *ids, steps,
                       progress=progress)
