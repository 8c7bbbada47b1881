"""The Typer app every command registers on, and the error policy of the whole command line.

Errors never reach a user as tracebacks: bad options are usage errors (exit 2, one line on
stderr naming the option), domain failures are ``TfmError`` (exit 1, one line).
"""

import importlib
import io
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup
from typer.models import CommandInfo

import tfmcli
from tfmcli.cli import screen
from tfmcli.cli.helpfit import FittedHelpCommand, fit_options_tables
from tfmcli.errors import TfmError

try:  # recent typer vendors click; older releases depend on it
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException


def _reader_left(console) -> None:
    """Rich's reaction to a closed pipe is ``SystemExit(1)``; tfm's is the ``BrokenPipeError``
    that ``OneLineErrors`` turns into a normal end (exit 0), for its own output and for the
    help that Typer prints through rich."""
    console.quiet = True
    raise BrokenPipeError


Console.on_broken_pipe = _reader_left


class TrimmedLines(io.TextIOBase):
    """Standard output for a pipe or a file: each line without the trailing spaces that rich
    pads its layouts with (help included), so that piped text diffs and greps cleanly."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            self.stream.write("\n".join(line.rstrip(" ") for line in lines) + "\n")
        return len(text)

    def flush(self):   # an unfinished line waits for its end, or for close_line
        self.stream.flush()

    def close_line(self):
        """Write what is left of an unfinished last line, trimmed."""
        if self.pending:
            self.stream.write(self.pending.rstrip(" "))
            self.pending = ""
        self.stream.flush()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def error(message: str) -> None:
    """One error on stderr: one line to a file or a pipe; on a terminal, broken between words
    to its width (the terminal itself would cut '--seed' after '--')."""
    if sys.stderr.isatty():
        import shutil

        from tfmcli.render.wrap import break_points

        cuts = break_points(message, screen.columns(shutil.get_terminal_size().columns))
        ends = [0, *cuts, len(message)]
        message = "\n".join(message[a:b].strip() for a, b in zip(ends, ends[1:]))
    typer.echo(message, err=True)


def command_path(args) -> str:
    """'tfm forward' when the command line names a command, else 'tfm'."""
    args = sys.argv[1:] if args is None else args
    name = next((str(arg) for arg in args if str(arg) in COMMANDS), None)
    return f"tfm {name}" if name else "tfm"


class OneLineErrors(TyperGroup):
    """Report every error as one line on stderr: usage errors exit 2, domain errors exit 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if os.environ.get("NO_COLOR"):   # help too: no escape codes at all, not even bold/dim
            from typer import rich_utils
            rich_utils.COLOR_SYSTEM = None
        if Console().width < screen.MIN_WIDTH:   # help too: drawn at the floor's width at least
            screen.floor_the_help()
        stdout = sys.stdout
        if not stdout.isatty():
            sys.stdout = TrimmedLines(stdout)
        try:
            code = super().main(args=args, prog_name="tfm", complete_var=complete_var,
                                standalone_mode=False, **extra)
        except ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) else "tfm"
            message = e.format_message().replace("Value error, ", "")  # typer's validator prefix
            if message:  # (no message: `tfm` alone, which has just printed its help)
                error(f"{where}: error: {message}")
            code = e.exit_code if message else 0
        except BrokenPipeError:  # `tfm ... | head`: the reader left; not an error
            # Point stdout at /dev/null so that the interpreter's last flush cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 0
        except OSError as e:   # stdout cannot take the output: a full disk (> /dev/full)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (as above)
            what = f"cannot use {e.filename}" if e.filename else "cannot write the output"
            error(f"{command_path(args)}: error: {what} ({e.strerror or e})")
            code = 1
        except TfmError as e:   # named as a usage error is: "tfm forward: error: ..."
            error(f"{command_path(args)}: error: {e}")
            code = 1
        except MemoryError:
            error(f"{command_path(args)}: error: out of memory; try smaller sizes (see tfm "
                  f"shapes)")
            code = 1
        except (typer.Abort, KeyboardInterrupt):
            typer.echo("tfm: interrupted", err=True)
            code = 130
        finally:
            if sys.stdout is not stdout:
                try:
                    sys.stdout.close_line()
                except OSError:   # a closed pipe, a full disk: said above, or nothing to say
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
                sys.stdout = stdout
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code

    def format_help(self, ctx, formatter):
        fit_options_tables()
        return super().format_help(ctx, formatter)

    def invoke(self, ctx):
        import numpy as np  # here, once a command runs: the help and --version never load it

        with np.errstate(all="ignore"):  # statistics of huge values must not print warnings
            try:
                return super().invoke(ctx)
            except KeyboardInterrupt:   # Typer would exit 130 in silence; main says why
                raise typer.Abort() from None


# Every command, in the order of --help, with the first paragraph of its docstring (the line
# the help lists; tests/test_startup.py holds the two equal). Command NAME lives in
# tfmcli/cli/NAME.py, whose @app.command() registers it when the module is imported.
COMMANDS = {
    "forward": (
        "Run the forward pass: config, shape trace of every activation, attention maps, loss."),
    "backward": "Forward + hand-written backward: a gradient table per parameter (and --check).",
    "gradcheck": (
        "Check every parameter's gradient against central differences; exit 1 if any fails."),
    "shapes": (
        "Every tensor's shape, parameter counts, FLOPs and memory, without allocating anything."),
    "embed": (
        "One position's embedding, number by number: W_E's row plus the position's; then its "
        "gradient."),
    "attn": (
        "One attention head step by step: X, Q, K, V, scores, scaled, masked, softmax, context."),
    "ln": (
        "One layer norm at one position, number by number: x, mean, variance, xhat, y; then dy to"
        " dx."),
    "ffn": "One feed-forward sublayer at one position: pre, activation, out; then dout to dx.",
    "block": (
        "One block's residual stream at one position: each sum, then dz back to dx, path by path."),
    "loss": (
        "The head and the loss at one position: logits, softmax, -log p; then (p - y) / N to dh."),
    "mask": "The causal grid, the padding rows and each row's combined mask (True = may attend).",
    "pe": (
        "The sinusoidal positional-encoding matrix as a heatmap, each column sin/cos + "
        "wavelength."),
    "train": (
        "Train a small model with Adam and the hand-written backward, then show what it learned."),
    "adam": (
        "Adam by hand: a few entries through a few updates, m, v, their corrections and the step."),
    "kv": (
        "Decode batch row --row one token at a time with a KV cache; each step against the full "
        "pass."),
    "lens": "The logit lens: after each block, the next tokens the model would predict there.",
    "check": (
        "Proof on demand: the run in PyTorch autograd, every number compared; exit 1 if any "
        "differs."),
    "compare": (
        "Pre-LN against Post-LN: the same seed and sizes, gradient norms per block, side by side."),
    "explore": (
        "Walk through every number of a run with the keyboard: tensors, cells, their formulas."),
    "patch": "Activation patching, clean into corrupted, beside attribution patching's estimate.",
    "attribute": (
        "Direct logit attribution: one logit as the sum of what each head, FFN and bias added."),
    "circuit": (
        "Edge attribution patching whose books balance, each top edge beside its real patch."),
    "precision": (
        "The run in bfloat16 (or --dtype) against float64: every tensor's error, own and "
        "inherited."),
}


class LazyCommands(typer.Typer):
    """A Typer app that imports the command modules when its commands are first asked for: all
    of them, or only those ``wanted`` (``main`` asks for the one being run)."""

    wanted = tuple(COMMANDS)

    def command(self, *args, **options):
        """A command as Typer makes it, whose --help fits the terminal (``helpfit``)."""
        options.setdefault("cls", FittedHelpCommand)
        return super().command(*args, **options)

    @property
    def registered_commands(self):
        wanted, self.wanted = self.wanted, ()   # first, so that each module's @app.command()
        for name in wanted:                     # reaches the list without recursing here
            importlib.import_module(f"tfmcli.cli.{name}")
        return self._registered

    @registered_commands.setter
    def registered_commands(self, value):
        self._registered = value


app = LazyCommands(   # the help is the root callback's docstring, examples included
    cls=OneLineErrors,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)



def version_callback(value: bool):
    if value:
        typer.echo(f"tfm {tfmcli.__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[Optional[bool], typer.Option(
        "--version", callback=version_callback, is_eager=True,
        help="Print the version and exit.")] = None):
    """See, number by number, what a transformer does forward and backward.

    Try: tfm forward --seed 1000;  tfm backward --layer ffn;  tfm mask --len 7

    A family's block at toy size: --arch llama, gemma2, ... (--arch list).
    Interventions: --ablate, --set, --scale, --patch (docs/interventions.md).
    Docs: docs/index.md
    """


def _listed_only():
    """Stands in for a command whose name and summary are all that is needed."""


def main():
    """The `tfm` entry point. A run of one command imports that command's module and builds
    only its Click command (importing all twelve and building them takes ~60 ms, and loads
    NumPy). ``tfm``, ``tfm --help``, ``--version`` and a mistyped name need only the names and
    summaries of the commands: stand-ins carry them, and nothing else is imported. Shell
    completion (``_TFM_COMPLETE`` set, the words in ``COMP_WORDS``) sees every command."""
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name in COMMANDS:
        app.wanted = (name,)
        app.registered_commands = [c for c in app.registered_commands
                                   if c.callback.__name__ == name]
    elif "_TFM_COMPLETE" not in os.environ:
        app.wanted = ()
        app.registered_commands = [CommandInfo(name, help=summary, callback=_listed_only)
                                   for name, summary in COMMANDS.items()]
    app()
