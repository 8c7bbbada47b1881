"""Start-up: a run loads what it runs. `tfm --help` lists the commands from their names and
summaries alone (no NumPy, no command module); a command imports its own module only. Times are
the benchmark's business (benchmarks/bench.py); these tests check what is imported."""

import inspect
import json
import os
import subprocess
import sys

import pytest

from tfmcli.cli import app
from tfmcli.cli.app import COMMANDS

LOADED = """
import json, sys
sys.argv = ["tfm", *json.loads(sys.argv[1])]
from tfmcli.cli import {entry}
try:
    {entry}()
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m == "numpy" or m.startswith("tfmcli"))),
      file=sys.stderr)
"""


def run_and_list_modules(args, entry="main"):
    """(stdout, the numpy and tfmcli modules imported) of a run of `tfm ARGS`."""
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-c", LOADED.format(entry=entry), json.dumps(args)],
                          capture_output=True, text=True, env=env, check=True)
    return done.stdout, set(json.loads(done.stderr.splitlines()[-1]))


def test_the_summaries_the_help_lists_are_the_commands_docstrings():
    commands = app.registered_commands   # every command module imported
    assert [c.callback.__name__ for c in commands] == list(COMMANDS)
    for command in commands:
        first_paragraph = inspect.getdoc(command.callback).split("\n\n")[0]
        assert COMMANDS[command.callback.__name__] == first_paragraph


def test_the_help_loads_neither_numpy_nor_a_command_and_reads_as_with_every_command():
    listed, loaded = run_and_list_modules(["--help"])
    assert "numpy" not in loaded
    assert not {f"tfmcli.cli.{name}" for name in COMMANDS} & loaded
    full, loaded_by_app = run_and_list_modules(["--help"], entry="app")   # the real commands
    assert {f"tfmcli.cli.{name}" for name in COMMANDS} <= loaded_by_app
    assert listed == full
    assert all(name in listed for name in COMMANDS)
    # every summary whole: rich reads "[t]" in help as markup and drops it
    words = " ".join(line.strip("│ ") for line in listed.splitlines())
    for summary in COMMANDS.values():
        assert " ".join(summary.split()) in " ".join(words.split()), summary


def test_a_command_loads_its_own_module_and_not_the_model():
    out, loaded = run_and_list_modules(["mask", "--len", "3"])
    assert out.count("●") == 1 + 6 + 3   # the legend, the causal grid, the padding row
    commands = {m.rsplit(".", 1)[1] for m in loaded if m.rsplit(".", 1)[0] == "tfmcli.cli"}
    assert commands & set(COMMANDS) == {"mask"}
    assert not {"tfmcli.engine.model", "tfmcli.check.gradcheck"} & loaded
    # side by side without rich's table (a tenth of the start-up), JSON only for --json
    assert not {"rich.table", "rich.columns", "json"} & loaded


def test_a_mistyped_command_still_gets_its_suggestion():
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "tfmcli", "forwad"], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == "tfm: error: No such command 'forwad'. Did you mean 'forward'?"


def test_the_folders_are_attributes_of_a_bare_import_tfmcli():
    """`import tfmcli` then `tfmcli.train.optim.adam_step`, as docs/api.md writes it."""
    code = ("import inspect, tfmcli; print(all(inspect.ismodule(getattr(tfmcli, n)) for n in "
            "('engine', 'explain', 'check', 'train', 'sources', 'render', 'io')), "
            "inspect.isfunction(tfmcli.train.optim.adam_step), "
            "inspect.isfunction(tfmcli.gradcheck))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr


def test_a_moved_module_still_resolves_and_says_where_it_went():
    import tfmcli
    from tfmcli.engine import ops

    with pytest.warns(DeprecationWarning, match=r"tfmcli\.ops moved to tfmcli\.engine\.ops"):
        assert tfmcli.ops is ops


def test_shell_completion_still_completes_a_commands_options():
    env = {**os.environ, "_TFM_COMPLETE": "complete_bash", "COMP_WORDS": "tfm forward --se",
           "COMP_CWORD": "2"}
    done = subprocess.run([sys.executable, "-m", "tfmcli"], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0 and "--seed" in done.stdout.split()

