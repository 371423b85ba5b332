"""A command that fails before writing its output leaves no folder behind: the parents
that output_lock created for the output are removed again while empty; a folder that
existed, or that something else wrote into, stays."""

from __future__ import annotations

import pytest

from prunelab.cli import cli_main
from prunelab.io.lock import output_lock


def test_folders_made_for_an_unwritten_output_are_removed(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    with output_lock(target):
        assert (tmp_path / "a" / "b").is_dir()
    assert sorted(tmp_path.iterdir()) == []


def test_a_written_output_keeps_its_folders(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    with output_lock(target):
        target.write_text("{}")
    assert target.read_text() == "{}"


def test_a_folder_written_into_or_existing_stays(tmp_path):
    (tmp_path / "a").mkdir()
    target = tmp_path / "a" / "b" / "c" / "model"
    with pytest.raises(RuntimeError):
        with output_lock(target):
            (tmp_path / "a" / "b" / "note.txt").write_text("someone else's")
            raise RuntimeError("the command failed")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["a", "a/b", "a/b/note.txt"]


def test_a_failed_command_leaves_no_out_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli_main(["--quiet", "prune", "depth", "--model", str(tmp_path / "missing"),
                     "--budget", "remove-blocks:1", "--out", "out/deeper/d1"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
