"""Tiny terminals (issue 69): COLUMNS=0, COLUMNS=1, COLUMNS=5 LINES=3 divided a heatmap by
zero and failed rich's assertions in titled tables. Every console is floored once
(``tfmcli.cli.screen``): below MIN_WIDTH x MIN_HEIGHT a command draws what it draws at the
floor, piped or on a terminal, and never a traceback."""

import io
import os
import pty
import re
import select
import struct
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from helpers import ANSI, plain_environment, run  # noqa: F401 (a fixture)
from tfmcli.cli import app, screen
from tfmcli.render import curve, heatmap, lens_table, maps_layout, mask_overview, tensor_table

# Every command (tfm --help lists them), the views the issue quoted, the help and an error.
COMMANDS = [
    ["forward"],
    ["forward", "--full"],
    ["backward"],
    ["backward", "--show", "blocks.0.attn.W_Q"],
    ["gradcheck", "--max-entries", "2"],
    ["shapes"],
    ["embed"],
    ["attn"],
    ["attn", "--query", "2", "--backward"],
    ["ln"],
    ["ffn"],
    ["block"],
    ["loss"],
    ["mask", "--len", "9"],
    ["mask", "--len", "60"],
    ["pe"],
    ["train", "--steps", "5"],
    ["adam"],
    ["kv"],
    ["lens"],
    ["check"],
    ["compare"],
    ["explore", "--keys", "down,enter,g"],
    ["patch", "--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"],
    ["circuit", "--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"],
    ["attribute"],
    ["precision", "-L", "2"],
    ["forward", "--json"],
    ["--help"],
    ["forward", "--help"],
]
WIDTHS = [0, 1, 2, 5, 10, 20]
LINES = [0, 1, 3]


def test_every_command_is_swept():
    assert {c.callback.__name__ for c in app.registered_commands} <= {a[0] for a in COMMANDS}


def tiny_run(monkeypatch, args, columns, lines, terminal):
    """`tfm ARGS` at COLUMNS x LINES, piped or (FORCE_COLOR) as rich's terminal: exit 0, no
    traceback, and the output (stdout) returned."""
    if args[0] == "check":
        pytest.importorskip("torch")
    if args[0] == "explore":
        pytest.importorskip("textual")
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("LINES", str(lines))
    if terminal:
        monkeypatch.setenv("FORCE_COLOR", "1")
    else:
        monkeypatch.delenv("FORCE_COLOR", raising=False)
    result = run(*args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.stdout


def untimed(text: str) -> str:
    """``text`` without the times it took (tfm train's "5 steps in 0.1 s")."""
    return re.sub(r" in \d+\.\d s\b", " in _ s", text)


@pytest.mark.parametrize("columns", WIDTHS)
@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_tiny_screen_draws_at_the_floor(monkeypatch, args, columns):
    """Piped and as a terminal, with LINES 0, 1 and 3 in turn (a different one each width and
    mode: every command meets each, both ways). Below the floor, the output is the floor's."""
    turn = WIDTHS.index(columns)
    for terminal in (False, True):
        lines = LINES[(turn + terminal) % len(LINES)]
        out = tiny_run(monkeypatch, args, columns, lines, terminal)
        assert len(out) < 100_000
        if columns < screen.MIN_WIDTH and args[0] != "explore":   # (which prints nothing)
            at_floor = tiny_run(monkeypatch, args, screen.MIN_WIDTH, lines, terminal)
            assert untimed(out) == untimed(at_floor)
        if not terminal and "--json" not in args:
            assert max(map(len, out.splitlines()), default=0) <= max(columns, screen.MIN_WIDTH)


def test_the_floor_keeps_a_column_of_numbers_whole(monkeypatch):
    """At COLUMNS=1, the 20 columns of the floor: the help's words and a tensor's numbers."""
    help_text = tiny_run(monkeypatch, ["--help"], 1, 0, False)
    assert "Usage: tfm" in help_text and "forward" in help_text
    shown = tiny_run(monkeypatch, ["backward", "--show", "blocks.0.attn.W_Q"], 1, 0, False)
    assert "blocks.0.attn.W_Q" in shown.replace("\n", "")


def test_a_wide_enough_screen_is_left_as_it_is():
    console = Console(file=io.StringIO(), width=screen.MIN_WIDTH, height=2)
    assert screen.floored(console).size == (screen.MIN_WIDTH, 2)
    console = Console(file=io.StringIO(), width=0, height=0)
    assert screen.floored(console).size == (screen.MIN_WIDTH, screen.MIN_HEIGHT)


@pytest.mark.parametrize("environ, size", [
    ({}, (120, 40)),
    ({"COLUMNS": "0", "LINES": "0"}, (screen.MIN_WIDTH, screen.MIN_HEIGHT)),
    ({"COLUMNS": "5", "LINES": "3"}, (screen.MIN_WIDTH, 3)),
    ({"COLUMNS": "wide", "LINES": "-1"}, (120, 40)),
    ({"COLUMNS": "90", "LINES": "30"}, (90, 30)),
])
def test_the_explorers_headless_screen_is_floored_too(environ, size):
    assert screen.size(environ) == size


def test_an_error_on_a_one_column_terminal_breaks_at_the_floor(monkeypatch, capsys):
    import shutil

    from tfmcli.cli.app import error

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: os.terminal_size((1, 1)))
    error("tfm forward: error: 0 is not allowed for '--seq-len' (allowed: 1 or more)")
    lines = capsys.readouterr().err.splitlines()
    assert 1 < len(lines) < 6 and max(map(len, lines)) <= screen.MIN_WIDTH


# ---------------------------------------------------------------- a real terminal


def on_a_pty(args, environ, winsize):
    """`tfm ARGS` with a pseudo-terminal of ``winsize`` (columns, lines) as stdin, stdout and
    stderr: (exit code, what the terminal received, escape codes removed)."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", winsize[1], winsize[0], 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR",
                                                             "FORCE_COLOR")}
    process = subprocess.Popen([sys.executable, "-m", "tfmcli", *args], env={**env, **environ},
                               stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    received = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            process.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:   # the child has closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    text = ANSI.sub("", received.decode("utf-8", "replace"))
    return process.wait(timeout=60), text.replace("\r\n", "\n")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("args", [["forward"], ["pe"], ["kv"], ["--help"]], ids=" ".join)
@pytest.mark.parametrize("environ, winsize", [
    ({"COLUMNS": "0", "LINES": "0"}, (80, 24)),
    ({"COLUMNS": "5", "LINES": "3"}, (80, 24)),
    ({}, (5, 3)),    # a terminal that small, COLUMNS unset
], ids=["COLUMNS=0", "COLUMNS=5", "a 5x3 terminal"])
def test_a_real_terminal_that_small_draws_at_the_floor(args, environ, winsize):
    code, text = on_a_pty(args, environ, winsize)
    assert code == 0, text
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and max(len(line.rstrip()) for line in lines) <= screen.MIN_WIDTH


# ---------------------------------------------------------------- the views, given any width


@pytest.mark.parametrize("width", [0, 1, 2, 5])
def test_every_view_takes_a_width_below_the_floor(width):
    """The renderers are public (``tfmcli.render``): at any width they lay out, and a titled
    table with no room for its columns is drawn at its narrowest, a character a column."""
    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(6, 6))
    pattern = np.tril(np.ones((6, 6)))
    pattern /= pattern.sum(1, keepdims=True)
    views = [heatmap(matrix, width=width, title="t"), heatmap(pattern, width=width),
             tensor_table(matrix, width=width, title="a title"),
             tensor_table(rng.normal(size=(3, 40)), width=width, full=True, title="x"),
             lens_table(["b0", "b1"], ["a", "b", "c"], ["b", "c", "d"],
                        [[[("x", 0.5)]] * 3] * 2, width=width),
             curve(list(range(10)), [1.0] * 10, title="t", width=width),
             mask_overview(np.tril(np.ones((50, 50), bool)), title="m", width=width)]
    assert maps_layout([(0, 0), (0, 1)], 6, width, False, 0, 2)[0] == [(0, 0)]
    for console_width in sorted({max(width, 1), screen.MIN_WIDTH}):
        console = Console(file=io.StringIO(), width=console_width, color_system=None)
        for view in views:
            console.print(view)
    if width:   # 7 columns (the labels, 6 numbers), 6 spaces between them: 13 at least
        console = Console(file=io.StringIO(), width=width, color_system=None)
        console.print(tensor_table(matrix, title="a title"), crop=False)
        lines = console.file.getvalue().splitlines()
        assert len(lines) == 9 and {len(line) for line in lines} == {13}
