"""``prunelab report DIR``: one self-contained ``report.html`` from a folder of prunelab's
outputs (a probe run, a depth sweep, a comparison or a recipe run)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from prunelab.cli.apps import app
from prunelab.cli.generated import generated_command


@app.command("report", cls=generated_command())
def report_cmd(
        folder: Path = typer.Argument(..., help="folder of a probe run, sweep, compare or run"),
        out_file: Optional[Path] = typer.Option(None, "--out",
                                                help="the HTML file (default DIR/report.html)"),
        overwrite: bool = typer.Option(False, help="replace an existing report file")):
    """Write DIR/report.html: model summary, probes, leaderboard, plots, commands."""
    from prunelab.report.folder import build_report

    path = build_report(folder, out_file, overwrite=overwrite)
    print(f"report: {path}")
