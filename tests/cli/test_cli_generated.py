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
