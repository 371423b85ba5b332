"""The typer applications (the command tree); commands register on them in
:mod:`prunelab.cli.inspect_cmds` and :mod:`prunelab.cli.prune_cmds`."""

from __future__ import annotations

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
        verbose: bool = typer.Option(False, "--verbose", "-v", help="tracebacks on errors")):
    """prunelab: probes, pruning and evaluation of transformers (0-based layer indices)."""
    log.set_quiet(quiet)
    state["verbose"] = verbose
