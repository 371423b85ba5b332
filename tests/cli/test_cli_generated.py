"""Options generated from a registered config's fields: a strategy registered from outside
(no CLI edit) gets typed options on ``prune depth`` (choices from ``Literal``, a range from
the metadata, a ``--no-...`` switch, a comma list), its values reach the config, and a bad
or misapplied value is a one-line error (exit 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from prunelab.cli import cli_main, prune_cmds
from prunelab.pruning import STRATEGIES
from prunelab.pruning.depth.strategies.base import Strategy


@pytest.fixture
def mine():
    @STRATEGIES.register("mine")
    @dataclass(frozen=True)
    class Mine(Strategy):
        """a test strategy"""

        mode: Literal["fast", "slow"] = field(default="fast", metadata={
            "cli": "mine_mode", "help": "mine: fast or slow"})
        depth: int = field(default=2, metadata={"cli": "mine_depth", "help": "mine: depth",
                                                "range": (1, 5)})
        share: bool = field(default=True, metadata={"cli": "mine_share", "help": "mine: share"})
        keep: tuple = field(default=(), metadata={"cli": "mine_keep", "help": "mine: kept"})

    yield Mine
    STRATEGIES.unregister("mine")


def _run(argv, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake(load, cfg, out_dir, overwrite, **kw):
        seen["cfg"] = cfg

    monkeypatch.setattr(prune_cmds, "prune_and_save", fake)
    code = cli_main(["prune", "depth", "--model", "m", "--out", str(tmp_path / "o"),
                     "--budget", "remove-blocks:1", *argv])
    cap = capsys.readouterr()
    return code, seen.get("cfg"), cap.out + cap.err


def test_help_lists_the_generated_options(mine, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli_main(["prune", "depth", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for flag in ("--mine-mode", "--mine-depth", "--no-mine-share", "--mine-keep"):
        assert flag in text
    assert "mine: depth (default 2)" in text and "| mine" in text


def test_values_reach_the_config(mine, tmp_path, monkeypatch, capsys):
    code, cfg, _ = _run(["--strategy", "mine", "--mine-mode", "slow", "--mine-depth", "4",
                         "--no-mine-share", "--mine-keep", "a, b"], tmp_path, monkeypatch,
                        capsys)
    assert code == 0
    assert cfg.select == mine(mode="slow", depth=4, share=False, keep=("a", "b"))
    code, cfg, _ = _run(["--strategy", "mine"], tmp_path, monkeypatch, capsys)
    assert code == 0 and cfg.select == mine()


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "mine", "--mine-mode", "medium"], "must be one of fast, slow"),
    (["--strategy", "mine", "--mine-depth", "9"], "must be in [1, 5]"),
    (["--strategy", "mine", "--mine-depth", "x"], "--mine-depth"),
    (["--strategy", "beam", "--mine-depth", "3"], "--mine-depth applies to --strategy mine only"),
    (["--strategy", "mine", "--beam-width", "3"], "--beam-width applies to --strategy beam only"),
    (["--strategy", "mine", "--mine-nope", "3"], "No such option"),
])
def test_bad_values_are_one_line_errors(mine, tmp_path, monkeypatch, capsys, argv, message):
    code, cfg, text = _run(argv, tmp_path, monkeypatch, capsys)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert code == 2 and cfg is None, text
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], text


def test_calibration_options_come_from_one_place():
    """--data --samples --seqlen --seed --batch-size of every command that prunes with
    calibration data are generated from prunelab.cli.common.Calibration (a command may
    change a default or a help line), never spelled again by hand."""
    import dataclasses
    import inspect as _inspect
    from pathlib import Path

    import typer

    from prunelab.cli import conditional_cmds, elastic_cmds, factor_cmds, prune_cmds
    from prunelab.cli.apps import prune_app, sweep_app
    from prunelab.cli.common import Calibration

    fields = {f.name: f for f in dataclasses.fields(Calibration)}
    group = typer.main.get_group(prune_app)
    defaults = {"depth": (32, 256), "sparsity": (64, 512), "width": (32, 256),
                "gates": (32, 256), "moe": (64, 512), "factor": (64, 512),
                "elastic": (32, 256)}
    for name, (samples, seqlen) in defaults.items():
        params = {p.name: p for p in group.commands[name].params}
        for f in fields.values():
            p = params[f.name]
            assert p.opts == ["--" + f.name.replace("_", "-")]
            assert p.help == f.metadata["help"] or f.name == "seed", (name, f.name)
        assert (params["samples"].default, params["seqlen"].default) == (samples, seqlen)
        assert params["data"].default == "wiki-vital:calib" and params["batch_size"].default == 8
    sweep = {p.name: p for p in typer.main.get_group(sweep_app).commands["depth"].params}
    assert sweep["seqlen"].help == "calibration window length" and sweep["samples"].default == 32
    for mod in (prune_cmds, conditional_cmds, factor_cmds, elastic_cmds):
        src = Path(_inspect.getsourcefile(mod)).read_text()
        assert 'help="calibration windows"' not in src and "BatchOpt" not in src, mod.__name__
