"""``run`` / ``compare --overwrite`` discard what a run wrote, never a user's file beside it."""

from __future__ import annotations

import json

import pytest

from prunelab.errors import OutputExistsError
from prunelab.workflow.run import discard_run, prepare_out


def _run_folder(root):
    out = root / "out"
    (out / "points" / "a" / "model").mkdir(parents=True)
    (out / "points" / "a" / "result.json").write_text("{}")
    (out / "run.json").write_text("{}")
    (out / "leaderboard.md").write_text("| x |")
    saved = out / "models" / "small"
    saved.mkdir(parents=True)
    (saved / "manifest.json").write_text(json.dumps({"recipe_stage": "save-3"}))
    (saved / "model.safetensors").write_bytes(b"x")
    (out / "notes.txt").write_text("mine")
    (out / "models" / "keep.txt").write_text("mine too")
    user_ckpt = out / "my-model"
    user_ckpt.mkdir()
    (user_ckpt / "manifest.json").write_text(json.dumps({"format": "prunelab"}))
    return out


def test_overwrite_removes_only_the_runs_own_files(tmp_path):
    out = _run_folder(tmp_path)
    prepare_out(out, overwrite=True)
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["models", "models/keep.txt", "my-model", "my-model/manifest.json",
                    "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_discard_returns_what_it_removed_and_keeps_a_symlinked_folder(tmp_path):
    out = _run_folder(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text(json.dumps({"recipe_stage": "save-1"}))
    (out / "link").symlink_to(elsewhere, target_is_directory=True)
    removed = discard_run(out)
    assert sorted(removed) == ["leaderboard.md", "models/small", "points", "run.json"]
    assert (elsewhere / "manifest.json").is_file() and (out / "link").is_symlink()


def test_a_folder_that_is_no_run_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "x.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        prepare_out(out, overwrite=True)
    assert (out / "x.txt").read_text() == "x"
