"""tfm explore: the run's every number under the keyboard, in a full-screen terminal app; with
a corrupted run (--from-tokens, as tfm circuit takes it), the circuit's edge scores too."""

import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tfmcli.cli.app import app
from tfmcli.cli.common import (
    FROM_OPTIONS,
    AnswerOption,
    Metric,
    MetricOption,
    StepsOption,
    WrongOption,
    check_metric,
    circuit_of,
    execute,
    metric_ids,
    progress_bar,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    RUN_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    with_options,
    writable,
)

# what --keys takes: Textual's key names, and the characters a person types for some of them
KEY_NAMES = {"]": "right_square_bracket", "[": "left_square_bracket",
             "}": "right_curly_bracket", "{": "left_curly_bracket", "/": "slash",
             "?": "question_mark", "esc": "escape"}
NAMED_KEYS = ("up", "down", "left", "right", "enter", "escape", "tab", "backspace",
              "pageup", "pagedown", "home", "end", *KEY_NAMES.values())
INSTALL = "tfm explore needs Textual: python -m pip install textual"
FROM = {name for name, _, _ in FROM_OPTIONS}   # the corrupted run's (or --patch's source)


def parse_keys(text: Optional[str]) -> list[str]:
    """'down,down,enter,g' -> Textual's key names; an unknown name is a usage error."""
    if text is None:
        return []
    keys = []
    for key in text.split(","):
        key = key.strip()
        name = KEY_NAMES.get(key, key)
        if not (name in NAMED_KEYS or (len(name) == 1 and name.isprintable())):
            raise typer.BadParameter(f"{key!r} is not a key; keys are a character (g, x, ], ...) "
                                     f"or one of {', '.join(NAMED_KEYS[:8])}",
                                     param_hint="'--keys'")
        keys.append(name)
    return keys


@app.command()
@with_options(MODEL_OPTIONS, [spec for spec in WHOLE_RUN_OPTIONS if spec[0] != "score_all"],
              [spec for spec in INTERVENE_OPTIONS if spec[0] not in FROM], FROM_OPTIONS)
def explore(
    keys: Annotated[Optional[str], typer.Option(
        "--keys", metavar="K,K,...",
        help="Press these keys (down,enter,g,...) without a terminal, then exit.")] = None,
    screenshot: Annotated[Optional[Path], typer.Option(
        "--screenshot", metavar="FILE.svg", callback=writable,
        help="With --keys: save the last screen as an SVG.")] = None,
    metric: MetricOption = None,
    answer: AnswerOption = None,
    wrong: WrongOption = None,
    steps: StepsOption = 0,
    opts: Options = None,
):
    """Walk through every number of a run with the keyboard: tensors, cells, their formulas.

    With a corrupted run (--from-tokens or --from-text, without --patch), its circuit too:
    every edge's score (as tfm circuit's), each explained as its two factors.

    Example: tfm explore --tokens 3,1,4,1,5 --keys "down,enter" --screenshot view.svg
    """
    pressed = parse_keys(keys)
    circuit = wants_circuit(opts, metric, answer, wrong, steps)
    if screenshot is not None and keys is None:
        raise typer.BadParameter("a screenshot is of the screen --keys leaves; add --keys",
                                 param_hint="'--screenshot'")
    if keys is None and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise typer.BadParameter("the explorer is full-screen and needs a terminal; without "
                                 "one, press keys with --keys K,K,... (and --screenshot FILE.svg)",
                                 param_hint="'explore'")
    try:
        import textual  # noqa: F401
    except ImportError:
        raise typer.BadParameter(INSTALL, param_hint="'explore'") from None
    from tfmcli.tui.app import ExploreApp
    from tfmcli.tui.state import Explorer

    opts.own_corrupted = circuit   # the circuit's, not a --patch's source: the run is clean
    run, fwd, grads = execute(opts, with_grads=True)
    made = None
    if circuit:
        with progress_bar("EAP-IG's runs") as tick:
            made = circuit_of(opts, run, metric or Metric.loss, metric_ids(run, answer, wrong),
                              steps, progress=tick if steps else None)
    explorer = Explorer(run, fwd, grads, typed(opts, skip=FROM if circuit else ()),
                        against=against(opts, run, fwd), circuit=made,
                        circuit_argv=circuit_words(opts, metric, answer, wrong, steps))
    application = ExploreApp(explorer, header(run))
    if keys is None:
        application.run()
        return
    import asyncio
    import os

    from tfmcli.cli.screen import size

    svg = asyncio.run(drive(application, pressed, size(os.environ)))
    if screenshot is not None:
        from tfmcli.io import save_outputs
        save_outputs(text_path=screenshot, text=svg)


def wants_circuit(opts: Options, metric, answer, wrong, steps) -> bool:
    """Whether the explorer computes a circuit: a corrupted run (--from-tokens or --from-text)
    without --patch, whose source it would be otherwise. --metric, --answer, --wrong and
    --steps say how the circuit is scored: usage errors without one; and a circuit is of the
    model as it is, so --ablate, --set and --scale are too beside it."""
    values = opts.values
    given = bool(values.get("from_tokens") or values.get("from_text"))
    circuit = given and not values.get("patch")
    scoring = [flag for flag, value in (("--metric", metric), ("--answer", answer),
                                        ("--wrong", wrong), ("--steps", steps)) if value]
    if scoring and not circuit:
        raise typer.BadParameter("it scores the circuit of a corrupted run: add --from-tokens "
                                 "IDS or --from-text TEXT" + (", without --patch" if given
                                                               else ""),
                                 param_hint=f"'{scoring[0]}'")
    changed = [flag for flag in ("--ablate", "--set", "--scale") if values.get(flag[2:])]
    if circuit and changed:
        flag = "--from-tokens" if values.get("from_tokens") else "--from-text"
        raise typer.BadParameter(f"without --patch it gives a circuit's corrupted run, and a "
                                 f"circuit is of the model as it is: drop {changed[0]}, or add "
                                 f"--patch TARGET to copy from it", param_hint=f"'{flag}'")
    if circuit:
        check_metric(metric or Metric.loss, answer, wrong)
    return circuit


def circuit_words(opts: Options, metric, answer, wrong, steps) -> list[str]:
    """The options that made the circuit, as typed: the corrupted run's and the metric's (tfm
    circuit's command line, after the model's)."""
    words = typed(opts, FROM_OPTIONS)
    for flag, value in (("--metric", metric and metric.value), ("--answer", answer),
                        ("--wrong", wrong), ("--steps", steps)):
        if value:
            words += [flag, shlex.quote(str(value))]
    return words


def against(opts: Options, run, fwd):
    """What the p key shows of a run in float32, float16 or bfloat16: a function making the
    same weights and tokens compared with float64 (``explain.precision.compared``), called
    at the first p; None for a float64 run; why not, for one an intervention changed (the
    comparison runs the model as it is)."""
    if run.cfg.dtype == "float64":
        return None
    if fwd.caches.get("plan"):
        return ("p compares the model as it is with float64; this run was changed (--ablate, "
                "--set, --scale, --patch): open it without them to compare")

    def compare():
        import numpy as np

        from tfmcli.cli.options import DType
        from tfmcli.explain.precision import compared

        dtype = run.cfg.dtype
        opts.values["dtype"] = DType.float64   # the weights read in float64, as precision's
        truth = opts.run(untyped={"dtype"})
        opts.values["dtype"] = DType(dtype)
        params = {name: np.asarray(value, dtype=np.float64)
                  for name, value in truth.complete().params.items()}
        return compared(params, truth.inputs, truth.cfg.replace(dtype="float64"), dtype)
    return compare


def header(run) -> str:
    """The top line: the sizes, the tokens of row 0, where the weights came from."""
    cfg = run.cfg
    tokens = " ".join(run.token_labels(0)[:12]) + (" …" if cfg.seq_len > 12 else "")
    return (f" tfm explore · B={cfg.batch} T={cfg.seq_len} d={cfg.d_model} H={cfg.heads} "
            f"L={cfg.layers} · {tokens} · {run.weights_from}")


async def drive(application, keys: list[str], size=(120, 40)) -> str:
    """Press ``keys`` in the app, headless, on a screen of ``size`` (columns, lines: the
    COLUMNS and LINES of the environment, else 120 x 40, never below ``screen``'s floor); the
    last screen as SVG."""
    async with application.run_test(size=size) as pilot:
        for key in keys:
            await pilot.press(key)
        await pilot.pause()
        return application.svg()


def typed(opts: Options, specs=None, skip=()) -> list[str]:
    """The model and input options the user typed (of ``specs``: the model's, the run's and
    the interventions' by default; not those named in ``skip``), as they would type them
    again."""
    from tfmcli.cli.options import FLAGS

    words = []
    if specs is None:
        specs = [*MODEL_OPTIONS, *RUN_OPTIONS, *INTERVENE_OPTIONS]
    for name, annotation, _ in specs:
        if name not in opts.values or not opts.explicit(name) or name in skip:
            continue
        value = opts.values[name]
        decl = str(annotation.__metadata__[0].default)
        flag = FLAGS.get(name, decl.split("/")[0])
        if isinstance(value, bool):
            on, _, off = decl.partition("/")
            words.append(on if value else off or on)
        elif isinstance(value, list):
            for item in value:
                words += [flag, shlex.quote(str(item))]
        else:
            words += [flag, shlex.quote(str(value.value if isinstance(value, Enum) else value))]
    return words
