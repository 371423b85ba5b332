"""The typer applications (the command tree); commands register on them in
:mod:`prunelab.cli.inspect_cmds` and :mod:`prunelab.cli.prune_cmds`."""

from __future__ import annotations

from typing import Optional

import typer

from prunelab import log
from prunelab.cli.common import state

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Measure where a transformer is redundant and remove it.")
prune_app = typer.Typer(no_args_is_help=True, help="Prune a model and save a checkpoint.")
sweep_app = typer.Typer(no_args_is_help=True, help="Pruning curves over several settings.")
app.add_typer(prune_app, name="prune")
app.add_typer(sweep_app, name="sweep")


@app.callback()
def _global_options(
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress or status"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="tracebacks on errors"),
        plugin: Optional[list[str]] = typer.Option(
            None, "--plugin", help="a Python file registering methods (repeatable; also "
            "$PRUNELAB_PLUGINS, os.pathsep-separated files or module names), imported "
            "before the command runs")):
    """prunelab: probes, pruning and evaluation of transformers (0-based layer indices)."""
    from prunelab.cli import plugins

    log.set_quiet(quiet)
    state["verbose"] = verbose
    plugins.set_cli(plugin)
    if not state.get("help"):  # help reads the plugins' options from the catalog
        plugins.load()
