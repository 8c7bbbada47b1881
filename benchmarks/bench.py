"""tfm's speed, measured honestly: the engine against NumPy's own matmul rate and PyTorch eager,
the command line's start-up against the bare imports it cannot avoid, and a large forward
view's drawing against its forward pass.

    python benchmarks/bench.py            # the block of issue 11, both dtypes, start-up
    python benchmarks/bench.py --quick    # a smaller block, fewer repeats, one pass
    python benchmarks/bench.py --where    # where a step's time goes, operation by operation

Every engine figure is the median of many forward + backward runs, timed in three passes
minutes apart (the other measurements between them), since this machine's speed drifts from
minute to minute. tfm and torch run on the same parameters and inputs, alternately in one
process, with a pause between calls so that neither inherits the other's spinning BLAS
threads, both on the same number of threads; a ratio is the median of the ratios of calls
made side by side in one round. The script unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for
itself (they slow NumPy's BLAS on some machines) and prints the BLAS kernel in use
(threadpoolctl). The torch columns are skipped when torch is not installed. A last table says
which of issue 11's targets the run met.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time

OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if __name__ == "__main__" and any(name in os.environ for name in OVERRIDES):
    # before NumPy loads its BLAS; imported (by a test), the module leaves the process alone
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import numpy as np  # noqa: E402
from rich import box  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import tfmcli  # noqa: E402
from tfmcli.engine.config import Config  # noqa: E402
from tfmcli.engine.memory import keep_freed_memory  # noqa: E402
from tfmcli.engine.sizes import flops  # noqa: E402

PAUSE = 0.2   # seconds between two timed calls: BLAS threads go back to sleep
PASSES, ROUNDS = 3, 11   # the block timed in 3 passes minutes apart, 11 rounds each
WHERE_ROUNDS = 15        # --where: one pass
WIDE = 120    # columns: a log file gets the whole table on one line, rules and all
HEADERS = ("what", "dtype", "tfm ms", "torch ms", "ratio", "GFLOP/s", "of peak", "faults")
PASS_HEADERS = ("pass", "dtype", "tfm ms", "torch ms", "tfm / torch", "of peak", "torch's")
# left out when torch was not timed
TORCH_COLUMNS = ("torch ms", "ratio", "tfm / torch", "torch's")
COMMAND_HEADERS = ("what", "dtype", "ms", "ratio")   # whole commands and start-up


def without_torch_unless_measured(headers, rows: list) -> tuple[list, list]:
    """(headers, rows), or both without the columns of torch's time and of tfm / torch when no
    row has a torch time (torch not installed, or --no-torch)."""
    torch = headers.index("torch ms")
    if any(row[torch] != "—" for row in rows):
        return list(headers), rows
    kept = [i for i, header in enumerate(headers) if header not in TORCH_COLUMNS]
    return [headers[i] for i in kept], [[row[i] for i in kept] for row in rows]


def block_label(fields: dict) -> str:
    return "B{batch} T{seq_len} d{d_model} H{heads} F{d_ff} V{vocab}".format(**fields)


def make_console() -> Console:
    """A terminal's own width (a table wider than the terminal would wrap into a mess), WIDE
    columns for a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=WIDE)


def make_table(console: Console, title: str, headers, caption: str | None = None,
               text: tuple = ("what",)) -> Table:
    """A table of figures: the ``text`` columns left-aligned, wrapped when the console is
    narrow, the figures right-aligned and never wrapped. Under WIDE columns the table drops its
    vertical rules, so that it fits 80."""
    narrow = console.width < WIDE   # no rules between columns, and one space fewer each side
    table = Table(title=title, caption=caption, pad_edge=not narrow, collapse_padding=narrow,
                  box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD)
    for header in headers:
        words = header in text
        table.add_column(header, justify="left" if words else "right", no_wrap=not words)
    return table


PRINTED = []   # (title, headers, rows, caption) of every table printed, for --docs


def print_table(console: Console, title: str, headers, rows, caption: str | None = None,
                text: tuple = ("what",)) -> None:
    """``make_table`` with these rows, printed (and kept for --docs)."""
    table = make_table(console, title, headers, caption, text)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    PRINTED.append((title, list(headers), [list(row) for row in rows], caption))


DOCS_START, DOCS_END = "<!-- bench.py --docs: start -->", "<!-- bench.py --docs: end -->"


def markdown(tables, machine: str) -> str:
    """The tables as Markdown, under a line saying where and when they were measured."""
    parts = [machine]
    for title, headers, rows, caption in tables:
        parts.append(f"**{title[0].upper() + title[1:]}**")
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
                  for row in rows]
        parts.append("\n".join(lines))
        if caption:
            parts.append(caption[0].upper() + caption[1:] + ".")
    return "\n\n".join(parts)


def write_docs(path, text: str) -> None:
    """Put ``text`` between the page's two markers, in place of what was there."""
    from pathlib import Path

    page = Path(path).read_text()
    start, end = page.index(DOCS_START) + len(DOCS_START), page.index(DOCS_END)
    Path(path).write_text(page[:start] + "\n" + text + "\n" + page[end:])


def blas_kernel() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (pip install threadpoolctl)"
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
                     f"({i.get('num_threads')} threads)" for i in infos) or "none found"


def timed(run) -> tuple[float, int]:
    """(seconds, minor page faults) of one call, after a pause that lets BLAS threads sleep."""
    time.sleep(PAUSE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    run()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def matmul(dtype, n: int = 2048):
    """One n^3 product: NumPy's own large-matmul rate is 2 n^3 over its time."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
    return (lambda: a @ b), 2 * n ** 3


def torch_step(params, inputs, cfg):
    """One forward + backward of the same model in PyTorch eager, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    F = torch.nn.functional
    dtype = getattr(torch, cfg.dtype)
    P = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in params.items()}
    tokens, targets = torch.as_tensor(inputs.tokens), torch.as_tensor(inputs.targets)
    B, T = tokens.shape
    d, H = cfg.d_model, cfg.heads
    pe = torch.tensor(tfmcli.engine.positional.sinusoidal(T, d), dtype=dtype)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    act = F.gelu if cfg.activation == "gelu" else F.relu

    def step():
        x = P["embed.W_E"][tokens] + pe
        for i in range(cfg.layers):
            p = f"blocks.{i}."
            h = F.layer_norm(x, (d,), P[p + "ln1.gamma"], P[p + "ln1.beta"], cfg.eps)
            q, k, v = ((h @ P[p + f"attn.W_{w}"] + P[p + f"attn.b_{w}"])
                       .view(B, T, H, d // H).transpose(1, 2) for w in "QKV")
            scores = (q @ k.transpose(-1, -2)) / (d // H) ** 0.5
            pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            context = (pattern @ v).transpose(1, 2).reshape(B, T, d)
            x = x + context @ P[p + "attn.W_O"] + P[p + "attn.b_O"]
            h = F.layer_norm(x, (d,), P[p + "ln2.gamma"], P[p + "ln2.beta"], cfg.eps)
            x = (
                x
                + act(h @ P[p + "ffn.W_1"] + P[p + "ffn.b_1"]) @ P[p + "ffn.W_2"]
                + P[p + "ffn.b_2"]
            )
        x = F.layer_norm(x, (d,), P["ln_f.gamma"], P["ln_f.beta"], cfg.eps)
        logits = x @ P["head.W_U"] + P["head.b_U"]
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(-1), ignore_index=-100)
        for leaf in P.values():
            leaf.grad = None
        loss.backward()

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    return step


DTYPES = ("float32", "float64")


class Block:
    """The block's timed calls per dtype: NumPy's own product (the peak), tfm's fast path, tfm's
    reference formulas, and torch when it is wanted and installed. ``time_pass`` times rounds
    of them, one call of each per round, so that all four see the same machine; a bench times
    several passes minutes apart, and every figure is a median over the rounds of them all."""

    def __init__(self, fields: dict, torch_wanted: bool):
        self.runs, self.product_flop, self.work = {}, {}, {}
        for dtype in DTYPES:
            cfg = Config(**fields, dtype=dtype)
            params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
            product, self.product_flop[dtype] = matmul(cfg.np_dtype)
            runs = {"peak": product}
            for fast in (True, False):   # the fast path (the default), then the reference
                runs[fast] = (lambda fast=fast, params=params, inputs=inputs, cfg=cfg:
                              tfmcli.backward(params, tfmcli.forward(params, inputs, cfg,
                                                                     fast=fast), cfg))
            step = torch_step(params, inputs, cfg) if torch_wanted else None
            if step is not None:
                runs["torch"] = step
            self.runs[dtype] = runs
            self.work[dtype] = sum(flops(cfg))
        # per dtype and call, one (seconds, page faults) per round; per pass, its rounds
        self.samples = {dtype: {key: [] for key in runs} for dtype, runs in self.runs.items()}
        self.passes: list[range] = []

    def time_pass(self, repeats: int) -> None:
        """``repeats`` rounds per dtype, after one untimed call of each (BLAS threads start,
        first-touch page faults, caches after the minutes of other work between passes)."""
        first = len(self.samples[DTYPES[0]]["peak"])
        for dtype, runs in self.runs.items():
            for run in runs.values():
                run()
            for _ in range(repeats):
                for key, run in runs.items():
                    self.samples[dtype][key].append(timed(run))
        self.passes.append(range(first, first + repeats))

    def figures(self, rounds: range | None = None, fast: bool = True) -> dict:
        """Per dtype, a path's figures over ``rounds`` (all by default): ``targets`` takes
        tfm / torch (None without torch) and the share of NumPy's peak, each the median of its
        per-round ratios (this machine's speed drifts by 20% from minute to minute, and the
        calls of a round share their minute); and the medians of the times, the peak's rate
        and the page faults of a tfm step."""
        out = {}
        for dtype, samples in self.samples.items():
            if rounds is not None:
                samples = {key: values[rounds.start:rounds.stop] for key, values in samples.items()}
            took = {key: statistics.median(t for t, _ in values) for key, values in samples.items()}
            to_peak = self.work[dtype] / self.product_flop[dtype]   # the block in peak products
            out[dtype] = {
                "tfm / torch": paired(samples[fast], samples["torch"]) if "torch" in took else None,
                "of peak": paired(samples["peak"], samples[fast]) * to_peak,
                "torch's": paired(samples["peak"], samples["torch"]) * to_peak
                           if "torch" in took else None,
                "tfm s": took[fast], "torch s": took.get("torch"),
                "peak": self.product_flop[dtype] / took["peak"],
                "faults": statistics.median(f for _, f in samples[fast])}
        return out

    def rows(self) -> list[list[str]]:
        """The block's table over every round: per dtype, the fast path and the reference."""
        paths = {fast: self.figures(fast=fast) for fast in (True, False)}
        rows = []
        for dtype in self.samples:
            for fast in (True, False):
                f = paths[fast][dtype]
                rows.append(["fast path" if fast else "reference", dtype, f"{f['tfm s'] * 1e3:.0f}",
                             shown(f["torch s"], 1e3, ".0f"), shown(f["tfm / torch"], 1, ".2f"),
                             f"{self.work[dtype] / f['tfm s'] / 1e9:.1f}",
                             f"{f['of peak']:.0%} of {f['peak'] / 1e9:.0f}",
                             f"{f['faults']:,.0f}"])
        return rows

    def pass_rows(self) -> list[list[str]]:
        """Per pass and dtype, the fast path's figures, to show how far the passes agree."""
        rows = []
        for number, rounds in enumerate(self.passes, 1):
            for dtype, f in self.figures(rounds).items():
                rows.append([f"pass {number}", dtype, f"{f['tfm s'] * 1e3:.0f}",
                             shown(f["torch s"], 1e3, ".0f"), shown(f["tfm / torch"], 1, ".3f"),
                             f"{f['of peak']:.2%}", shown(f["torch's"], 1, ".2%")])
        return rows


def shown(value: float | None, scale: float, spec: str) -> str:
    """A figure as its table cell: ``value * scale`` formatted, or a dash when it was not
    measured (torch's time and tfm / torch without torch)."""
    return "—" if value is None else format(value * scale, spec)


def paired(top: list, bottom: list) -> float:
    """The median over rounds of top's time / bottom's time in the same round."""
    return statistics.median(t / b for (t, _), (b, _) in zip(top, bottom))


def command_time(args: list[str], repeats: int) -> float:
    """Median wall time of the command ``args``, output discarded, without the BLAS overrides."""
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(args, stdout=subprocess.DEVNULL, env=env, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tfm(*args: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "tfm"), *args]


def compiled() -> bool:
    """tfm's modules compiled to bytecode, as ``pip install .`` (the README's) compiles them
    and as NumPy's, Typer's and Rich's, the import floor's, were; whether that took. Where
    PYTHONDONTWRITEBYTECODE is set (this machine sets it) an editable install never writes
    them, and every start compiles tfm's modules again: ``tfm mask --len 7`` took 136 ms
    without them and 112 with them, against the floor's 86 (1.58 and 1.30 times it; fresh
    processes, 15 rounds, alternately)."""
    import compileall

    import tfmcli

    return bool(compileall.compile_dir(os.path.dirname(tfmcli.__file__), quiet=2))


def startup_rows(repeats: int) -> tuple[list, dict]:
    """The import floor and two commands, alternately (this machine's start-up time drifts by
    20% from minute to minute): medians over rounds, and the median of each round's ratio (also
    per command, as ``targets`` takes them). tfm's modules are compiled to bytecode before
    (``compiled``)."""
    imports = "import numpy, typer, rich"
    commands = {imports: [sys.executable, "-c", imports],
                "tfm mask --len 7": tfm("mask", "--len", "7"), "tfm --help": tfm("--help")}
    samples = {label: [] for label in commands}
    for _ in range(repeats):
        for label, args in commands.items():
            samples[label].append(command_time(args, 1))
    floor = samples[imports]
    ratios = {label: statistics.median(t / f for t, f in zip(times, floor))
              for label, times in samples.items()}
    rows = [[label, "", f"{statistics.median(times) * 1e3:.0f}", f"{ratios[label]:.2f}"]
            for label, times in samples.items()]
    del ratios[imports]   # the floor itself: 1.00
    return rows, ratios


# issue 11's targets: (the figure, at most or at least, the goal)
GOALS = (("tfm / torch", "at most", 0.9), ("of peak", "at least", 0.75))
STARTUP_GOAL = 1.3   # a command's start-up over the import floor, at most


def targets(engine: dict, startup: dict, drawing: dict | None = None) -> list[list[str]]:
    """Rows of (target, dtype or command, measured, goal, met) for issue 11's targets: each
    dtype's fast path against torch and against NumPy's peak, each command's start-up against
    the import floor, and a command's drawing against its forward pass (``drawing``: command ->
    drawing / forward). A figure is judged as it prints (a share to 0.01%, a ratio to 0.001), so
    that the row reads true; a figure not measured (no torch) is left out."""
    rows = []
    for dtype, figures in engine.items():
        for name, way, goal in GOALS:
            if figures[name] is None:
                continue
            value = round(figures[name], 4 if name == "of peak" else 3)
            met = value <= goal if way == "at most" else value >= goal
            shown = (f"{value:.2%}", f"{way} {goal:.0%}") if name == "of peak" else (
                f"{value:.3f}", f"{way} {goal:.2f}")
            rows.append([name, dtype, *shown, "yes" if met else "no"])
    for command, ratio in startup.items():
        value = round(ratio, 3)
        rows.append(["start-up / import floor", command, f"{value:.3f}",
                     f"at most {STARTUP_GOAL:.2f}", "yes" if value <= STARTUP_GOAL else "no"])
    for command, ratio in (drawing or {}).items():
        value = round(ratio, 3)
        rows.append(["drawing / forward pass", command, f"{value:.3f}", "less than 1.00",
                     "yes" if value < 1 else "no"])
    return rows


GPT2_SMALL = ("-d", "768", "-H", "12", "-L", "12", "-V", "50257", "--pe", "learned",
              "--n-ctx", "1024", "--tied-head", "--no-head-bias", "--activation", "gelu")


def command_rows(repeats: int) -> list[list[str]]:
    """Whole commands a learner waits for, wall time (start-up, init and rendering included)."""
    rows = []
    for label, args in (("tfm train (the defaults)", ["train"]),
                        ("tfm backward, GPT-2 small's shape, 32 tokens",
                         ["backward", *GPT2_SMALL, "-B", "1", "-T", "32"])):
        took = command_time(tfm(*args), repeats)
        rows.append([label, "float64", f"{took * 1e3:,.0f}", ""])
    return rows


DRAWN = ("forward", "-B", "1", "-d", "768", "-H", "12", "-T", "1024")   # issue 11's third target

# Run in a child: a tfm command as its console script runs it, with the forward pass (the
# engine's forward, inside the command's execute) and the drawing (common.emit: statistics,
# tables, maps, printed) timed apart by ``timing`` (its source, below: importing this file
# would load rich's console, 35 ms, before the command does, and the drawing would not pay for
# it); their seconds are the child's last line on stderr, as JSON.
DRAWING_TIMER = """
import json, sys, time
import tfmcli
from tfmcli.cli import common, main
spent = {{"forward": 0.0, "drawing": 0.0}}
{timing}
tfmcli.forward = timing(tfmcli.forward, "forward", spent)
common.emit = timing(common.emit, "drawing", spent)   # before a command module imports it
sys.argv = ["tfm", *sys.argv[1:]]
try:
    main()
finally:
    print(json.dumps(spent), file=sys.stderr)
"""


def drawing_times(args, width: int = 120, height: int = 50) -> dict:
    """{"forward": s, "drawing": s} of one run of ``tfm args``, drawn as for a colour terminal
    of ``width`` x ``height`` (the output itself discarded), without the BLAS overrides."""
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    env.update(FORCE_COLOR="1", COLUMNS=str(width), LINES=str(height))
    env.pop("NO_COLOR", None)
    child = DRAWING_TIMER.format(timing=inspect.getsource(timing))
    done = subprocess.run([sys.executable, "-c", child, *args], env=env, check=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return json.loads(done.stderr.splitlines()[-1])


def drawing_rows(repeats: int) -> tuple[list, dict]:
    """``tfm forward`` at GPT-2 small's width on 1,024 tokens: its forward pass and its drawing
    (statistics included), each run a fresh process as a learner's is; medians over runs, and
    the median of each run's drawing / forward (also as ``targets`` takes it)."""
    runs = [drawing_times(DRAWN) for _ in range(repeats)]
    ratio = statistics.median(run["drawing"] / run["forward"] for run in runs)
    label = "tfm " + " ".join(DRAWN)
    short = "tfm forward (d 768, T 1024)"   # the table's first column stays narrow
    rows = [[f"{short}: forward pass", "float64",
             f"{statistics.median(run['forward'] for run in runs) * 1e3:,.0f}", ""],
            [f"{short}: drawing", "float64",
             f"{statistics.median(run['drawing'] for run in runs) * 1e3:,.0f}", f"{ratio:.2f}"]]
    return rows, {label: ratio}


HALF = "half the batch, one core"   # a --where row: see one_core_half

# The operations the model calls, each timed on the calling thread inside a step by --where.
TIMED_OPS = ("embedding_forward", "layer_norm_forward_fast", "linear_forward",
             "attention_forward_fast", "relu_forward", "gelu_forward", "cross_entropy_forward",
             "cross_entropy_dprobs", "cross_entropy_backward", "linear_backward", "relu_backward",
             "gelu_backward", "layer_norm_backward_fast", "attention_backward_fast",
             "embedding_backward_fast")


def timing(function, name: str, spent: dict):
    """``function``, adding the seconds each call takes to ``spent[name]``."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return call


def one_core_half(params, inputs, cfg):
    """A step on the first half of the batch with tfm and BLAS on one core, or None when tfm
    cannot hold NumPy's BLAS. Two cores scale perfectly when the whole step takes as long."""
    from tfmcli.engine import parallel

    control = parallel.blas_threads()
    if control is None or cfg.batch < 2:
        return None
    half = cfg.batch // 2
    cfg_half = dataclasses.replace(cfg, batch=half, lengths=cfg.lengths and cfg.lengths[:half])
    inputs_half = tfmcli.Inputs(*(array[:half] for array in inputs))
    get, set_ = control

    def step():
        threads = get()
        set_(1)   # BLAS on one thread: tfm cuts nothing either (parallel._threads)
        try:
            tfmcli.backward(params, tfmcli.forward(params, inputs_half, cfg_half), cfg_half)
        finally:
            set_(threads)
    return step


def where_rows(fields: dict, repeats: int) -> list[list[str]]:
    """Per dtype: the forward, the backward and each operation, in ms per step (medians over
    rounds), timed on the calling thread. A linear layer's backward counts dx: its dW is made
    on tfm's other thread meanwhile, and what the backward waits for it is in "the rest".
    In the same rounds, half the batch on one core: how near the step is to perfect scaling."""
    from tfmcli.engine import ops

    rows = []
    for dtype in ("float32", "float64"):
        cfg = Config(**fields, dtype=dtype)
        params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
        half = one_core_half(params, inputs, cfg)
        spent = dict.fromkeys(TIMED_OPS, 0.0)
        real = {name: getattr(ops, name) for name in TIMED_OPS}
        activations = dict(ops.ACTIVATIONS)

        for name in TIMED_OPS:
            setattr(ops, name, timing(real[name], name, spent))
        ops.ACTIVATIONS.update({key: (getattr(ops, f"{key}_forward"),
                                      getattr(ops, f"{key}_backward")) for key in activations})
        samples = {key: [] for key in ("step", "forward", "backward", *TIMED_OPS, "rest",
                                       HALF)}
        try:
            for round_ in range(repeats + 1):    # the first round warms up
                if half is not None:
                    samples[HALF].append(timed(half)[0])
                spent.update(dict.fromkeys(spent, 0.0))
                time.sleep(PAUSE)
                start = time.perf_counter()
                fwd = tfmcli.forward(params, inputs, cfg)
                middle = time.perf_counter()
                tfmcli.backward(params, fwd, cfg)
                end = time.perf_counter()
                if round_:
                    times = {"step": end - start, "forward": middle - start,
                             "backward": end - middle, **spent,
                             "rest": end - start - sum(spent.values())}
                    for key, value in times.items():
                        samples[key].append(value)
        finally:
            for name in TIMED_OPS:
                setattr(ops, name, real[name])
            ops.ACTIVATIONS.update(activations)
        step = statistics.median(samples["step"])
        samples[HALF] = samples[HALF][1:]   # after the warm-up round
        for key, values in samples.items():
            if not values:
                continue
            took = statistics.median(values)
            if key in TIMED_OPS and took == 0.0:
                continue
            rows.append([key, dtype, f"{took * 1e3:.1f}", f"{took / step:.0%}"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller block, fewer repeats")
    parser.add_argument("--no-torch", action="store_true", help="leave the torch column out")
    parser.add_argument("--where", action="store_true",
                        help="where a step's time goes, operation by operation")
    parser.add_argument("--docs", metavar="PAGE", default=None,
                        help="write the tables into PAGE between its markers "
                        "(docs/performance.md)")
    parser.add_argument("--passes", type=int, default=None,
                        help=f"times the block is timed, minutes apart (default {PASSES}; "
                        "--quick 1)")
    args = parser.parse_args()
    if args.passes is None:
        args.passes = 1 if args.quick else PASSES
    elif args.passes < 1:
        parser.error(f"argument --passes: {args.passes} is not allowed (allowed: 1 or more)")
    fields = dict(batch=2, seq_len=512, d_model=512, heads=8, d_ff=2048, vocab=512,
                  causal=True, norm="pre", layers=1)
    if args.quick:
        fields.update(seq_len=128, d_model=256, d_ff=1024)
    repeats = 3 if args.quick else WHERE_ROUNDS if args.where else ROUNDS
    kept = keep_freed_memory()   # as the commands that run the model do
    console = make_console()
    console.print(f"BLAS: {blas_kernel()}")
    console.print(
        f"freed memory kept in the heap (tfmcli.engine.memory): {'yes' if kept else 'no'}"
    )
    console.print("tfm's modules compiled to bytecode, as pip install . does: " + (
        "yes" if compiled() else "no (not writable here: every command below compiles them "
        "too, and start-up counts it)"))
    if args.where:
        print_table(console, "where a step's time goes (forward + backward of the block)",
                    ("what", "dtype", "ms", "of the step"), where_rows(fields, repeats),
                    "ms per step on the calling thread, medians over rounds; a linear "
                    "backward counts dx (its dW is made on tfm's other thread "
                    "meanwhile); the rest: sums, Python, waiting for the other thread; "
                    "half the batch, one core: the step on B/2 sequences with tfm and "
                    "BLAS on one thread (at 100% of the step, two cores would scale "
                    "perfectly)")
        return
    block = Block(fields, not args.no_torch)
    # Other work between the passes, so that each pass times its own minutes: the machine's
    # speed drifts, and the figures are medians over the rounds of every pass
    found = {"commands": [], "drawing": {}}

    def commands():
        found["commands"] += command_rows(3)
        drawn, found["drawing"] = drawing_rows(5)
        found["commands"] += drawn

    def startup():
        # 41 rounds: a process's start-up jitters by a third either way on this machine (a
        # round's ratio ran from 0.78 to 1.69 over 21 rounds), more than the drift that
        # pairing cancels
        found["start"], found["startup"] = startup_rows(41)

    interludes = ([] if args.quick else [commands]) + [startup]
    for number in range(args.passes):
        if number and interludes:
            interludes.pop(0)()
        block.time_pass(repeats)
    for work in interludes:
        work()

    headers, rows = without_torch_unless_measured(HEADERS, block.rows())
    print_table(console, "tfm forward + backward of one block with its head and loss, "
                f"{block_label(fields)}", headers, rows,
                f"over {args.passes} × {repeats} rounds; "
                + ("ratio: tfm / torch, the median over rounds of each round's ratio; "
                   if "ratio" in headers else "")
                + "peak: NumPy's own 2048^3 matmul rate in GFLOP/s, timed in the same "
                "rounds (of peak: also per round); faults: minor page faults per tfm "
                "step; reference: forward(..., fast=False)")
    if args.passes > 1:
        headers, rows = without_torch_unless_measured(PASS_HEADERS, block.pass_rows())
        print_table(console, "the fast path in each pass", headers, rows,
                    "each pass's own medians; "
                    + ("torch's: torch's own share of the peak; " if "torch's" in headers
                       else "")
                    + "the table above and the targets take the rounds of every pass",
                    text=("pass",))
    print_table(console, "whole commands, and start-up", COMMAND_HEADERS,
                found["commands"] + found["start"],
                "ratio: drawing / the forward pass (the median over runs of each run's), "
                "the command / the import floor (the median over rounds of each round's)")
    if args.quick:   # the targets are the full block's
        return
    goals = make_table(console, "issue 11's targets, in this run",
                       ("target", "for", "measured", "goal", "met"),
                       text=("target", "for", "goal", "met"))
    engine = {dtype: {name: figures[name] for name, _, _ in GOALS}
              for dtype, figures in block.figures().items()}
    met = targets(engine, found["startup"], found["drawing"])
    for row in met:
        goals.add_row(*row, style=None if row[-1] == "yes" else "bold red")
    console.print(goals)
    PRINTED.append(("issue 11's targets, in this run", ["target", "for", "measured", "goal",
                                                        "met"], met, None))
    if args.docs:
        write_docs(args.docs, markdown(PRINTED, machine_line()))


def machine_line() -> str:
    """'Measured on 2026-11-28: 2 cores (AMD EPYC ...), OpenBLAS ..., NumPy 2.4.6, torch ...'."""
    import platform

    try:
        import torch
        torch_version = f", torch {torch.__version__}"
    except ImportError:
        torch_version = ""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.machine()) \
        if os.path.exists("/proc/cpuinfo") else platform.machine()
    return (f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores of {cpu}: "
            f"{blas_kernel()}, NumPy {np.__version__}{torch_version}.")


if __name__ == "__main__":
    main()
