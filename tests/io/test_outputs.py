"""Issue 39, outputs: an output is never an input of the same command (resolved paths,
symlinks followed, with or without overwrite); written files get the usual modes; a full
disk is one line and leaves nothing behind; heal's state folder is its own (marked),
anything else is refused and only heal's own files are removed."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

import prunelab
from prunelab.checkpoint import save as savemod
from prunelab.errors import OutputExistsError, OutputWriteError
from prunelab.io.files import check_not_input, check_output_path, write_json, write_text
from prunelab.report.html import write_report
from prunelab.train.state import (
    MARKER_FILE,
    STATE_FILE,
    STATE_FORMAT,
    check_state_dir,
    claim_state_dir,
    release_state_dir,
)

from tiny_models import save_tiny_checkpoint


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _listing(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


# ---------------------------------------------------------------- output is never an input

def test_output_equal_inside_or_holding_an_input_is_refused(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for out, how in ((model, "is the input"), (model / "sub", "lies inside"),
                     (tmp_path, "holds"), (model / "config.json", "lies inside")):
        with pytest.raises(OutputWriteError, match=how) as ei:
            check_not_input(out, {"--model": str(model)})
        assert "\n" not in str(ei.value) and "--model" in str(ei.value)
    check_not_input(tmp_path / "other", {"--model": str(model)})  # a sibling is fine


def test_output_input_rule_follows_symlinks_and_ignores_overwrite(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(model)
    with pytest.raises(OutputWriteError, match="may never be an input"):
        check_output_path(tmp_path / "link", kind="checkpoint", overwrite=True,
                          inputs={"--model": str(model)})
    with pytest.raises(OutputWriteError, match="may never be an input"):
        check_output_path(model, kind="checkpoint", overwrite=True,
                          inputs={"--model": str(tmp_path / "link")})


def test_specs_that_name_nothing_on_disk_are_not_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_not_input("smollm2-135m", {"--model": "smollm2-135m", "--data": None})
    check_not_input("out", {"--model": "org/model", "--tasks": ["arc_easy"]})


def test_save_refuses_to_write_over_the_checkpoint_it_was_loaded_from(tmp_path):
    src = save_tiny_checkpoint("llama", tmp_path / "m")
    before = _listing(src)
    lm = prunelab.load(str(src))
    with pytest.raises(OutputWriteError, match="is the input model"):
        prunelab.save(lm, src, overwrite=True)
    with pytest.raises(OutputWriteError, match="lies inside the input model"):
        prunelab.save(lm, src / "pruned")
    assert _listing(src) == before


# ---------------------------------------------------------------- modes and full disks

def test_written_files_get_the_usual_modes(tmp_path, umask022):
    assert _mode(write_json(tmp_path / "a.json", {"x": 1})) == 0o644
    assert _mode(write_text(tmp_path / "a.txt", "x")) == 0o644
    assert _mode(write_report(tmp_path / "r")) == 0o644
    lm = prunelab.load(str(save_tiny_checkpoint("llama", tmp_path / "m")))
    out = prunelab.save(lm, tmp_path / "saved")
    assert _mode(out) == 0o755
    modes = {p.name: _mode(p) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and modes["manifest.json"] == 0o644, modes
    assert set(modes.values()) == {0o644}


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        assert _mode(write_json(tmp_path / "a.json", {})) == 0o600
    finally:
        os.umask(old)


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_in_write_text_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "keep.txt").write_text("old")
    monkeypatch.setattr(os, "fsync", _enospc)
    for name in ("new.txt", "keep.txt"):
        with pytest.raises(OutputWriteError, match="no space left on device") as ei:
            write_text(tmp_path / name, "page", overwrite=True)
        assert "\n" not in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "old"


def test_full_disk_during_a_checkpoint_save_is_one_line_and_leaves_nothing(tmp_path,
                                                                            monkeypatch):
    lm = prunelab.load(str(save_tiny_checkpoint("llama", tmp_path / "m")))
    out = tmp_path / "out"

    def half_written(path, obj, overwrite=False):
        path.write_text('{"half": ')
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(savemod, "write_json", half_written)
    with pytest.raises(OutputWriteError, match="no space left on device") as ei:
        prunelab.save(lm, out)
    assert "\n" not in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folder, no out


# ---------------------------------------------------------------- heal's state folder

def test_state_folder_is_created_and_marked(tmp_path):
    folder = claim_state_dir(tmp_path / "a" / "state")
    assert json.loads((folder / MARKER_FILE).read_text())["format"] == STATE_FORMAT
    assert claim_state_dir(folder) == folder  # a resume claims it again


def test_state_refuses_what_heal_did_not_create(tmp_path, monkeypatch):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    model = save_tiny_checkpoint("llama", tmp_path / "m")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for bad, why in ((user, "not a heal state"), (empty, "not a heal state"),
                     (tmp_path / "file", "is a file"), (".", "current folder"),
                     ("..", "current folder")):
        with pytest.raises(OutputWriteError, match=why) as ei:
            claim_state_dir(bad)
        assert "\n" not in str(ei.value)
    for bad in (model, model / "state"):
        with pytest.raises(OutputWriteError, match="may never be an input"):
            check_state_dir(bad, {"--model": str(model)})
    assert (user / "notes.txt").read_text() == "mine" and not (empty / MARKER_FILE).exists()


def test_release_removes_only_heals_own_files(tmp_path):
    folder = claim_state_dir(tmp_path / "state")
    (folder / STATE_FILE).write_bytes(b"x")
    write_json(folder / "heal-state.json", {})
    assert release_state_dir(folder) and not folder.exists()
    folder = claim_state_dir(tmp_path / "state")
    (folder / "notes.txt").write_text("put here by a user")
    assert not release_state_dir(folder)
    assert (folder / "notes.txt").read_text() == "put here by a user"
    user = tmp_path / "user"
    user.mkdir()
    (user / STATE_FILE).write_bytes(b"x")
    (user / "other").write_text("y")
    assert not release_state_dir(user)  # unmarked: never touched
    assert sorted(p.name for p in user.iterdir()) == ["heal-state.pt", "other"]


def test_an_earlier_heals_unmarked_state_is_accepted(tmp_path):
    legacy = tmp_path / "old"
    legacy.mkdir()
    (legacy / STATE_FILE).write_bytes(b"x")
    (legacy / "heal-state.json").write_text("{}")
    assert claim_state_dir(legacy) == legacy and (legacy / MARKER_FILE).is_file()


def test_existing_file_targets_and_folders(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputExistsError, match="is a folder, not a file"):
        check_output_path(tmp_path / "d", kind="file", overwrite=False)


def test_state_may_not_overlap_the_run_s_output_even_before_it_exists(tmp_path):
    out = tmp_path / "out"
    for state in (out, out / "state", tmp_path):
        with pytest.raises(OutputWriteError, match="may not overlap"):
            check_state_dir(state, outputs={"--out": out})
    check_state_dir(tmp_path / "out.heal-state", outputs={"--out": out})
    assert not out.exists()
