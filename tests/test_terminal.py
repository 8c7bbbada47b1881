"""What a person meets in a real terminal: closed pipes, output paths, wide tables, big masks,
labels, legends and plain text (issue 10)."""

import os
import subprocess
import sys

import pytest

from tfmcli.cli import app
from helpers import error_line, run

# One quick run of every command (and of the help), each writing more than one line.
EVERY_COMMAND = [
    ["forward"], ["backward"], ["gradcheck", "--max-entries", "2"], ["shapes"], ["attn"],
    ["mask", "--len", "9"], ["pe"], ["train", "--steps", "5"], ["kv"], ["lens"],
    ["check"], ["compare"], ["forward", "--json"], ["--help"],
    ["forward", "--help"],
]


def test_every_command_is_covered():
    named = {args[0] for args in EVERY_COMMAND}
    assert {c.callback.__name__ for c in app.registered_commands} <= named


@pytest.mark.parametrize("args", EVERY_COMMAND, ids=" ".join)
def test_a_closed_pipe_is_a_normal_end(args):
    """`tfm ... | head -1` under `set -o pipefail`: exit 0 and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader has left before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "tfmcli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


@pytest.mark.parametrize("flag", ["--svg", "--save"])
@pytest.mark.parametrize("command", ["forward", "train"])
def test_an_output_path_that_cannot_be_written_stops_before_any_work(tmp_path, flag, command):
    missing = tmp_path / "no-such-folder" / "out.file"
    result = run(command, flag, missing, "--steps" if command == "train" else "--seed", 3)
    assert "does not exist" in error_line(result, 2)
    assert result.stdout == ""
    result = run(command, flag, tmp_path, "--steps" if command == "train" else "--seed", 3)
    assert "is a folder" in error_line(result, 2)
    assert result.stdout == "" and os.listdir(tmp_path) == []
