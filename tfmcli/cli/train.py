"""tfm train: watch a small model learn a toy task, then look inside it."""

import json
import time
from enum import Enum
from typing import Annotated

import numpy as np
import typer
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

import tfmcli
from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Rate,
    Warmup,
    check_rate,
    describe,
    emit,
    height,
    position_labels,
    width,
)
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    RUN_OPTIONS,
    Options,
    bounded,
    check_memory,
    choice,
    with_options,
)
from tfmcli.cli.screen import floored
from tfmcli.errors import ConfigError
from tfmcli.train.tasks import TASKS, make_batch, refusal

Task = Enum("Task", {name: name for name in TASKS}, type=str)
HELD_OUT = 256      # held-out examples for the final accuracy
SHOWN = 4           # held-out examples printed (and saved with --save)
DEFAULTS = {"batch": 32, "d_model": 32, "heads": 2, "seed": 0}
FIELDS = ("arch", "seed", "batch", "d_model", "heads", "d_ff", "layers", "norm", "activation", "pe",
          "init", "dtype", "eps", "rms_norm", "kv_heads", "rope_theta", "bias", "rope_scaling",
          "qkv_bias", "sliding_window", "head_dim", "qk_norm", "embed_scale",
          "attn_softcap", "logit_softcap", "attn_scale", "sandwich_norm", "sliding_layers",
          "rope_local_theta", "rotary_dim", "parallel_residual", "shared_norm", "ffn_bias",
          "embed_norm", "norm_bias")
TRAIN_MODEL_OPTIONS = [(name, annotation, DEFAULTS.get(name, default))
                       for name, annotation, default in MODEL_OPTIONS if name in FIELDS]
TOKENS = [spec for spec in RUN_OPTIONS if spec[0] in ("tokens", "score_all", "force")]


@app.command()
@with_options(TRAIN_MODEL_OPTIONS, TOKENS, OUTPUT_OPTIONS)
def train(
    task: Annotated[Task, choice(
        "--task", choices=Task,
        help="What to do with the symbols before the separator.")] = Task.copy,
    steps: Annotated[int, typer.Option(
        "--steps", callback=bounded(1, 1_000_000), help="Training steps (1..1000000).")] = 600,
    warmup: Warmup = 100,
    lr: Rate = None,
    length: Annotated[int, typer.Option(
        "--len", "-n", callback=bounded(1, 256),
        help="Symbols per example before the separator (1..256); T = 2 n.")] = 8,
    symbols: Annotated[int, typer.Option(
        "--symbols", callback=bounded(2, 10_000),
        help="Distinct symbols (2..10000); the separator is the next id, V = symbols + 1.")] = 10,
    opts: Options = None,
):
    """Train a small model with Adam and the hand-written backward, then show what it learned.

    Example: tfm train --task reverse --save reverse.npz
    """
    from tfmcli.engine.inputs import IGNORE
    from tfmcli.engine.memory import keep_freed_memory
    from tfmcli.engine.model import block_masks
    from tfmcli.io import run_arrays
    from tfmcli.sources import Run, parse_tokens
    from tfmcli.train.loop import evaluate

    check_rate(opts, lr)
    problem = refusal(task.value, length, symbols)
    if problem is not None:
        raise typer.BadParameter(problem[1], param_hint=f"'{problem[0]}'")
    cfg = opts.config(seq_len=2 * length, vocab=symbols + 1, causal=True, lengths=None)
    if not opts.force:   # before any array: a step (or the held-out pass) and Adam's m and v
        from tfmcli.engine.sizes import param_count

        adam = 2 * param_count(cfg) * cfg.np_dtype.itemsize
        check_memory(cfg.replace(batch=max(cfg.batch, HELD_OUT)), extra=adam,
                     what="a training step, the held-out pass and Adam's state", opts=opts)
    try:
        shown_tokens = parse_tokens(opts.tokens)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="'--tokens'") from None
    if shown_tokens is not None:
        bad = [t for row in shown_tokens for t in row if not 0 <= t <= symbols]
        if bad:
            raise typer.BadParameter(f"id {bad[0]} is outside 0..{symbols} (the symbols and the "
                                     f"separator {symbols})", param_hint="'--tokens'")

    keep_freed_memory()   # each step's arrays reuse the memory of the step before
    params = tfmcli.init_params(cfg)
    started = time.perf_counter()
    history = run_training(params, cfg, task.value, steps, length, symbols, warmup, lr, opts.json)
    seconds = time.perf_counter() - started

    held_out = make_batch(
        task.value, np.random.default_rng([cfg.seed, 2]), HELD_OUT, length, symbols
    )
    accuracy, fwd_all = evaluate(params, cfg, held_out)
    task_info = {"task": task.value, "n": length, "symbols": symbols}
    if shown_tokens is not None:   # scored as training scores them, or every position
        from tfmcli.train.tasks import scored_as_trained

        shown, scored = scored_as_trained(tfmcli.inputs_from_tokens(shown_tokens), task_info,
                                          opts.score_all)
    else:
        shown = tfmcli.Inputs(*(a[:SHOWN] for a in held_out))
    B, T = shown.tokens.shape
    shown_cfg = cfg.replace(
        batch=B,
        seq_len=T,
        lengths=None if np.all(shown.lengths == T) else tuple(shown.lengths.tolist()),
    )
    fwd = tfmcli.forward(params, shown, shown_cfg)
    trained = f"trained on {task.value}, {render.counted(steps, 'step')} (seed {cfg.seed})"
    run = Run(shown_cfg, params, shown, trained,
              "--tokens" if shown_tokens is not None else "held-out examples", arch=opts.arch,
              task=task_info, scored=scored if shown_tokens is not None else "the answers")
    opts.made = run   # --json: the examples shown, after training

    predictions = fwd_all.acts["logits"].argmax(axis=-1)
    panel = describe(shown_cfg, run)   # the examples shown: B is theirs, not the training batch's
    panel["sizes"] = panel["sizes"].replace(f"B={B} ", f"B={B} shown (trained in batches of "
                                                       f"{cfg.batch}) ", 1)
    parts = [render.config_panel({**panel, "task": task_line(task.value, length, symbols),
                                  "schedule": schedule_line(cfg, warmup, lr)}, title="tfm train"),
             render.curve(history.steps, history.losses, title="training loss (cross-entropy "
                          "over the answer positions of each batch)", width=width(), log=True),
             render.curve(history.steps, history.lrs, title="learning rate", width=width(),
                          height=5),
             prediction_table(held_out, predictions, length, symbols)]
    queries, keys = position_labels(run, 0, "q"), position_labels(run, 0, "k")
    picked, values = render.maps_layout([(b, h) for b in range(cfg.layers)
                                         for h in range(cfg.heads)], T, width(), False,
                                        height(), max(map(cell_len, queries)))
    patterns = {(b, h): fwd.acts[f"blocks.{b}.attn.pattern"][0, h] for b, h in picked}
    masks = block_masks(cfg, shown.lengths, T, 0)
    maps = render.attention_maps(patterns, masks, 0, width(), total=cfg.layers * cfg.heads,
                                 row_labels=queries, col_labels=keys, values=values)
    parts += [*maps,
              Text(f"held-out token accuracy {accuracy:.1%} over "
                   f"{int((held_out.targets != IGNORE).sum()):,} answer tokens of {HELD_OUT:,} "
                   f"examples; {render.counted(steps, 'step')} in {seconds:.1f} s", style="bold")]
    payload = {"task": task.value, "steps": steps,
               "loss": [[s, loss] for s, loss in zip(history.steps, history.losses)],
               "final_accuracy": accuracy,
               "lr": [[s, rate] for s, rate in zip(history.steps, history.lrs)],
               "config": json.loads(cfg.to_json()), "seconds": seconds}
    arrays = {**run_arrays(shown_cfg, params, shown, fwd), "task": np.array(json.dumps(task_info))}
    emit(opts, parts, payload, arrays)


def run_training(params, cfg, task, steps, n, symbols, warmup, lr, quiet):
    """train() with a live progress bar (loss and accuracy) on a terminal."""
    from tfmcli.train.loop import train as train_model

    rng = np.random.default_rng([cfg.seed, 1])
    kwargs = dict(steps=steps, n=n, symbols=symbols, warmup=warmup, lr=lr)
    console = floored(Console(stderr=True))
    if quiet or not console.is_terminal:
        return train_model(params, cfg, task, rng, **kwargs)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )
    columns = [TextColumn("training"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.0%}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("train", total=steps, loss=float("nan"), acc=0.0)
        return train_model(params, cfg, task, rng, **kwargs, on_step=lambda step, loss, acc:
                           progress.update(bar, completed=step, loss=loss, acc=acc))


def task_line(task, n, symbols):
    if task == "induction":
        return (f"induction: {n} distinct symbols of 0..{symbols - 1}, separator {symbols}, "
                f"then the same from a random offset; scored where the current token was "
                f"followed by one in the prompt")
    return (f"{task}: {n} symbols of 0..{symbols - 1}, separator {symbols}, then the answer; "
            f"only answer positions are scored")


def schedule_line(cfg, warmup, lr):
    from tfmcli.train.optim import warmup_lr

    if lr is not None:
        return f"Adam (0.9, 0.98, 1e-9), constant lr {lr:g}"
    peak = warmup_lr(warmup, cfg.d_model, warmup)
    return (f"Adam (0.9, 0.98, 1e-9), lr = d^-0.5 min(step^-0.5, step warmup^-1.5), "
            f"warmup {warmup}: peak {peak:.4g} at step {warmup}")


def prediction_table(held_out, predictions, n, symbols, rows=SHOWN) -> Table:
    """A few held-out examples: the prompt, the right answer, the model's, and how many agree.
    The answer's positions a task does not score (induction's random first symbol and the one
    after the wrap) show as a dim dot."""
    from tfmcli.engine.inputs import IGNORE

    table = Table(title="held-out predictions", box=None, padding=(0, 2), header_style="dim")
    for header in ("prompt", "answer", "predicted", "right"):
        table.add_column(header, justify="left" if header != "right" else "right")
    for b in range(min(rows, len(held_out.tokens))):
        answer, predicted = held_out.targets[b][n:], predictions[b][n:]   # the answer's n
        scored = answer != IGNORE
        marks = Text()
        for a, p in zip(answer, predicted):
            if a == IGNORE:
                marks.append("· ", style="dim")
            else:
                marks.append(f"{p} ", style="green" if a == p else "bold red")
        table.add_row(" ".join(map(str, held_out.tokens[b][:n])),
                      " ".join(str(a) if a != IGNORE else "·" for a in answer), marks,
                      f"{int((answer == predicted)[scored].sum())}/{int(scored.sum())}")
    return table
