"""The tfm command line: one module per command, registered on one Typer app.

Adding a command: write ``tfmcli/cli/NAME.py`` with an ``@app.command()`` function (gather
options, build the run through ``common.execute``, call the engine, hand renderables to
``common.emit``) and add NAME to ``app.COMMANDS``; the order there is the order of ``--help``.
The modules are imported when the app's commands are first asked for (``app.LazyCommands``).

A command module imports the engine (``tfmcli.engine.model``, ``io``, ``sources``, ...) inside the
functions that use it, not at the top: ``--help`` imports every command module, and each
should pay only for what it runs.
"""

from tfmcli.cli.app import app, main

__all__ = ["app", "main"]
