"""Issue 39, outputs at the command line: no command writes over one of its inputs (with
or without --overwrite), `report` replaces nothing without --overwrite and never a file it
reads, `heal --state` never uses (or deletes) a folder it did not create."""

from __future__ import annotations

import errno
import os

import pytest

from prunelab.cli import cli_main

from tiny_models import SAMPLE_TEXT, cli_here, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_outputs")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    res = cli_inproc("--quiet", "prune", "sparsity", "--model", str(root / "model"), "--method",
                     "magnitude", "--data", f"text:{root / 'text.txt'}", "--seqlen", "16",
                     "--samples", "2", "--out", str(root / "sparse"))
    assert res.returncode == 0, res.stderr
    return root


def _listing(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _one_line(res, *words):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_no_command_writes_over_its_input(root, capsys):
    m, data = str(root / "model"), ["--data", f"text:{root / 'text.txt'}", "--seqlen", "16"]
    before = _listing(root / "model")
    (root / "link").unlink(missing_ok=True)
    (root / "link").symlink_to(root / "model")
    cases = [
        ["prune", "sparsity", "--model", m, "--method", "magnitude", *data, "--out", m,
         "--overwrite"],
        ["prune", "sparsity", "--model", str(root / "link"), "--method", "magnitude", *data,
         "--out", m, "--overwrite"],
        ["prune", "depth", "--model", m, *data, "--budget", "remove-blocks:1", "--out",
         f"{m}/pruned"],
        ["prune", "factor", "--model", m, "--method", "svd-llm", *data, "--budget",
         "keep-params:0.8", "--out", m, "--overwrite"],
        ["export", "--model", m, "--budget", "keep-units:0.5", "--out", m, "--overwrite"],
        ["heal", "--model", m, *data, "--out", m, "--overwrite"],
        ["eval", "--model", m, *data, "--json", f"{m}/config.json", "--overwrite"],
        ["info", "--model", m, "--json", f"{m}/x.json"],
        ["probe", "--model", m, "--probe", "block-influence", *data, "--out", f"{m}/probes"],
        ["prune", "sparsity", "--model", m, "--method", "magnitude", "--data",
         f"text:{root / 'text.txt'}", "--out", str(root / "text.txt"), "--overwrite"],
        ["recipe", "--from", str(root / "sparse"), "--out",
         str(root / "sparse" / "manifest.json"), "--overwrite"],
    ]
    for args in cases:  # refused before any model loads: run in this process
        _one_line(cli_here(capsys, *args), "may never be an input")
    assert _listing(root / "model") == before
    assert (root / "text.txt").read_text() == SAMPLE_TEXT * 3


def test_report_replaces_nothing_without_overwrite_and_never_an_input(root, tmp_path):
    sparse = root / "sparse"
    manifest = (sparse / "manifest.json").read_bytes()
    res = cli_inproc("report", str(sparse), "--out", str(sparse / "manifest.json"), "--overwrite")
    _one_line(res, "may never be an input")
    assert (sparse / "manifest.json").read_bytes() == manifest
    mine = tmp_path / "mine.html"
    mine.write_text("my notes")
    _one_line(cli_inproc("report", str(sparse), "--out", str(mine)), "exists", "--overwrite")
    assert mine.read_text() == "my notes"
    _one_line(cli_inproc("report", str(sparse), "--out", str(tmp_path)), "not a file")
    res = cli_inproc("report", str(sparse), "--out", str(mine), "--overwrite")
    assert res.returncode == 0, res.stderr
    assert mine.read_text().startswith("<!DOCTYPE html>") or "<html" in mine.read_text()
    (sparse / "report.html").unlink(missing_ok=True)
    assert cli_inproc("report", str(sparse)).returncode == 0
    first = (sparse / "report.html").read_bytes()
    _one_line(cli_inproc("report", str(sparse)), "exists")
    assert (sparse / "report.html").read_bytes() == first
    assert cli_inproc("report", str(sparse), "--overwrite").returncode == 0


def test_report_on_a_full_disk_is_one_line(root, tmp_path, monkeypatch, capsys):
    def enospc(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", enospc)
    assert cli_main(["report", str(root / "sparse"), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no space left on device" in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_heal_state_never_uses_a_folder_it_did_not_create(root, tmp_path, capsys):
    m, data = str(root / "sparse"), ["--data", f"text:{root / 'text.txt'}", "--seqlen", "16"]
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    (tmp_path / "work").mkdir()
    model_before = _listing(root / "sparse")
    for state, words in ((str(user), ["not a heal state"]), (m, ["may never be an input"]),
                         ("..", ["current folder"]), (".", ["current folder"]),
                         (str(tmp_path / "file"), ["is a file"]),
                         (str(tmp_path / "out"), ["may not overlap"]),
                         (str(tmp_path / "out" / "s"), ["may not overlap"])):
        res = cli_here(capsys, "heal", "--model", m, *data, "--steps", "2", "--out",
                       str(tmp_path / "out"), "--state", state, cwd=tmp_path / "work")
        _one_line(res, *words)
    assert (user / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "user", "work"]
    assert _listing(root / "sparse") == model_before


def test_heal_removes_only_its_own_state_folder(root, tmp_path):
    m, data = str(root / "sparse"), ["--data", f"text:{root / 'text.txt'}", "--seqlen", "16"]
    state = tmp_path / "deep" / "state"
    res = cli_inproc("--quiet", "heal", "--model", m, *data, "--steps", "2", "--batch-size", "2",
                     "--eval-data", "none", "--out", str(tmp_path / "healed"), "--state",
                     str(state))
    assert res.returncode == 0, res.stderr
    assert not state.exists() and (tmp_path / "deep").is_dir()  # the parent is kept
    assert (tmp_path / "healed" / "manifest.json").is_file()
