"""``--overwrite`` replaces only what prunelab wrote: a checkpoint folder whose
``manifest.json`` (prunelab's format) lists every file in it. A user's folder that looks
like a checkpoint (``config.json``), a plain Hugging Face checkpoint, or a prunelab
checkpoint with a user's file added is refused in one line naming the files it would lose,
and left as it was, by every command that writes a checkpoint."""

from __future__ import annotations

import json

import pytest

import prunelab
from prunelab.errors import OutputExistsError
from prunelab.io.files import checkpoint_files, foreign_files
from prunelab.models.loading import wrap

from tiny_models import SAMPLE_TEXT, char_tokenizer, cli_here, save_tiny_checkpoint, tiny_model


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _users_folder(path):
    path.mkdir()
    (path / "config.json").write_text('{"mine": true}')
    (path / "user.txt").write_text("mine\n")
    (path / "sub").mkdir()
    (path / "sub" / "notes.md").write_text("# notes\n")
    return path


def test_foreign_files_by_the_manifest(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    ck = prunelab.save(lm, tmp_path / "ck")
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["files"] == checkpoint_files(ck) and "manifest.json" in manifest["files"]
    assert foreign_files(ck) == []
    (ck / "sub").mkdir()
    (ck / "sub" / "notes.md").write_text("x")
    (ck / "empty").mkdir()
    assert foreign_files(ck) == ["empty/", "sub/notes.md"]
    hf = tmp_path / "hf"
    tiny_model("llama").save_pretrained(hf)
    assert foreign_files(hf) == checkpoint_files(hf) == ["config.json", "generation_config.json",
                                                         "model.safetensors"]
    # a manifest written before it listed its files: a checkpoint's usual files are its own
    del manifest["files"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert foreign_files(ck) == ["empty/", "sub/notes.md"]


def test_save_overwrite_keeps_a_users_files(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    user = _users_folder(tmp_path / "user")
    hf = tmp_path / "hf"
    tiny_model("llama").save_pretrained(hf)
    ours = prunelab.save(lm, tmp_path / "ours")
    (ours / "user.txt").write_text("added by hand\n")
    for folder, what in ((user, "is not a checkpoint prunelab wrote"),
                         (hf, "is not a checkpoint prunelab wrote"),
                         (ours, "holds files prunelab did not write")):
        before = _snapshot(folder)
        with pytest.raises(OutputExistsError) as exc:
            prunelab.save(lm, folder, overwrite=True)
        assert what in str(exc.value) and "--overwrite would lose" in str(exc.value)
        assert _snapshot(folder) == before
    assert "would lose config.json, sub/notes.md, user.txt;" in _message(lm, user)
    assert "would lose user.txt;" in _message(lm, ours)
    (ours / "user.txt").unlink()
    prunelab.save(lm, ours, overwrite=True)  # only its own files: replaced


def _message(lm, folder) -> str:
    with pytest.raises(OutputExistsError) as exc:
        prunelab.save(lm, folder, overwrite=True)
    return str(exc.value)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


COMMANDS = {
    "prune sparsity": ["prune", "sparsity", "--budget", "remove-weights:0.5"],
    "prune depth": ["prune", "depth", "--budget", "remove-blocks:1"],
    "prune width": ["prune", "width", "--budget", "remove-units:0.25"],
    "prune factor": ["prune", "factor", "--budget", "remove-hidden:0.25"],
    "prune gates": ["prune", "gates", "--budget", "remove-compute:0.2"],
    "heal": ["heal", "--steps", "1", "--eval-data", "text:{t}"],
}


@pytest.mark.parametrize("kind", ["user", "hf"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_to_overwrite_what_it_did_not_write(command, kind, assets,
                                                                  tmp_path, capsys):
    out = tmp_path / "out"
    if kind == "user":
        _users_folder(out)
    else:
        tiny_model("llama").save_pretrained(out)
    before = _snapshot(tmp_path)
    args = [a.format(t=assets / "text.txt") for a in COMMANDS[command]]
    res = cli_here(capsys, "--quiet", *args, "--model", str(assets / "model"), "--data",
                   f"text:{assets / 'text.txt'}", "--seqlen", "16", "--out", str(out),
                   "--overwrite")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert lines[0].startswith(f"error: {out} is not a checkpoint prunelab wrote")
    assert "--overwrite would lose config.json" in lines[0]
    assert _snapshot(tmp_path) == before


def test_prune_overwrite_replaces_its_own_checkpoint(assets, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--quiet", "prune", "sparsity", "--model", str(assets / "model"), "--data",
            f"text:{assets / 'text.txt'}", "--seqlen", "16", "--samples", "2", "--out",
            str(out)]
    assert cli_here(capsys, *args).returncode == 0
    first = json.loads((out / "manifest.json").read_text())["created"]
    res = cli_here(capsys, *args, "--overwrite", "--budget", "remove-weights:0.25")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["operations"][-1]["config"][
        "sparsity"] == 0.25 and first
    (out / "sub").mkdir()
    (out / "sub" / "notes.md").write_text("mine")
    res = cli_here(capsys, *args, "--overwrite")
    assert res.returncode == 2 and "holds files prunelab did not write: --overwrite would " \
        "lose sub/notes.md;" in " ".join(res.stderr.split())
    assert (out / "sub" / "notes.md").read_text() == "mine"
