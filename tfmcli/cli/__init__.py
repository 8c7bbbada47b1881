"""The tfm command line: one module per command, registered on one Typer app.

Adding a command: write ``tfmcli/cli/NAME.py`` with an ``@app.command()`` function (gather
options, build the run through ``common.execute``, call the engine, hand renderables to
``common.emit``) and add NAME to the import below; the order there is the order of ``--help``.

A command module imports the engine (``tfmcli.model``, ``io``, ``sources``, ...) inside the
functions that use it, not at the top: ``--help`` and every run import all command modules,
and each should pay only for what it runs.
"""

from tfmcli.cli.app import app, main
from tfmcli.cli import forward, backward, gradcheck, shapes, attn, mask, pe, train, kv, lens, check, compare  # noqa: F401,E402  (registry)

__all__ = ["app", "main"]
