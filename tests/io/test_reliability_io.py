"""Issue 12 (reliability), loading and output side: no silent random weights, corrupt
inputs and pickles refused in one line, flags reach the reference model, outputs written
by one process at a time, atomically, durably, never replacing the wrong kind of thing,
and output paths checked before any work. Fixtures are tiny checkpoints made here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import prunelab
from prunelab.checkpoint import save as savemod
from prunelab.data.batches import TokenBatches
from prunelab.errors import (
    CorruptCheckpointError,
    MissingWeightsError,
    ModelNotFoundError,
    OutputExistsError,
    OutputWriteError,
    PickleRefusedError,
)
from prunelab.io import files as filesmod
from prunelab.io import lock as lockmod
from prunelab.io.files import check_output_path, write_json
from prunelab.io.lock import clean_leftovers, move_noreplace, output_lock, publish_once
from prunelab.models import conversion, loading
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens

SRC = str(Path(__file__).resolve().parents[2] / "src")
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama checkpoint (4 blocks) with the char tokenizer."""
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("base") / "ckpt")


def variant(base: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(base, out)
    return out


def edit_weights(path: Path, fn) -> None:
    sd = load_file(path / "model.safetensors")
    fn(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and text
    return text


# ---------------------------------------------------------------- 1. no silent random weights

def test_missing_tensor_is_an_error_naming_it_unless_allowed(base, tmp_path):
    ckpt = variant(base, tmp_path)
    edit_weights(ckpt, lambda sd: sd.pop(UP))
    with pytest.raises(MissingWeightsError) as ei:
        prunelab.load(str(ckpt))
    msg = one_line(ei)
    assert "1 missing" in msg and UP in msg and "--allow-missing-weights" in msg
    lm = prunelab.load(str(ckpt), allow_missing_weights=True)
    ref = load_file(base / "model.safetensors")
    got = lm.model.state_dict()
    assert not torch.equal(got[UP], ref[UP])  # the gap was filled (at random), as allowed
    key = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(got[key], ref[key])


def test_config_with_more_blocks_than_weights_names_the_blocks(base, tmp_path):
    ckpt = variant(base, tmp_path)
    edit_config(ckpt, num_hidden_layers=6)
    with pytest.raises(MissingWeightsError) as ei:
        prunelab.load(str(ckpt))
    msg = one_line(ei)
    assert "18 missing (model.layers.4-5 (whole blocks))" in msg
    assert prunelab.load(str(ckpt), allow_missing_weights=True).adapter.num_blocks == 6


def test_config_with_fewer_blocks_than_weights_is_unexpected(base, tmp_path):
    ckpt = variant(base, tmp_path)
    edit_config(ckpt, num_hidden_layers=3)
    with pytest.raises(MissingWeightsError, match=r"9 unexpected \(model\.layers\.3 "
                                                  r"\(whole blocks\)\)"):
        prunelab.load(str(ckpt))


def test_mis_shaped_tensor_names_both_shapes(base, tmp_path):
    ckpt = variant(base, tmp_path)
    edit_weights(ckpt, lambda sd: sd.__setitem__(UP, torch.zeros(40, 32)))
    with pytest.raises(MissingWeightsError) as ei:
        prunelab.load(str(ckpt))
    assert f"{UP} is [40, 32] in the checkpoint but [48, 32] in the config" in one_line(ei)
    lm = prunelab.load(str(ckpt), allow_missing_weights=True)
    assert lm.model.state_dict()[UP].shape == (48, 32)


def test_tied_lm_head_is_not_missing(tmp_path):
    """SmolLM2-style: tie_word_embeddings and no lm_head.weight in the file."""
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    lm = prunelab.load(str(tmp_path))
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()


def test_encoder_checkpoint_with_task_head_loads(tmp_path):
    """A BERT saved with its MLM head: the head is not the encoder's (not unexpected),
    and its missing pooler is only noted (prunelab mean-pools)."""
    import transformers as tf

    from tiny_models import tiny_config

    torch.manual_seed(0)
    tf.BertForMaskedLM(tiny_config("bert")).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    assert prunelab.load(str(tmp_path)).adapter.num_blocks == 4


def test_zero_blocks_is_one_line(base, tmp_path):
    ckpt = variant(base, tmp_path)
    edit_config(ckpt, num_hidden_layers=0)
    with pytest.raises(CorruptCheckpointError, match="declares 0 blocks") as ei:
        prunelab.load(str(ckpt))
    one_line(ei)


# ---------------------------------------------------------------- 2. corrupt inputs

@pytest.mark.parametrize("kind", ["truncated", "empty", "garbage"])
def test_corrupt_safetensors_is_one_line(base, tmp_path, kind):
    ckpt = variant(base, tmp_path)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                   "garbage": bytes(range(256)) * 20}[kind])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors") as ei:
        prunelab.load(str(ckpt))
    assert "deserializing header" in one_line(ei)


@pytest.mark.parametrize("kind", ["missing", "garbage", "wrong-structure"])
def test_missing_or_corrupt_tokenizer_is_one_line(base, tmp_path, kind):
    ckpt = variant(base, tmp_path)
    if kind == "missing":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (ckpt / name).unlink()
    else:
        (ckpt / "tokenizer.json").write_text("{garbage" if kind == "garbage" else '{"a": 1}')
    with pytest.raises(CorruptCheckpointError, match="tokenizer") as ei:
        prunelab.load(str(ckpt))
    one_line(ei)


@pytest.mark.parametrize("data", [b"", b"not a gguf file at all" * 10, b"GGUF\xff\xff\xff\x7f"])
def test_garbage_or_empty_gguf_is_one_line(tmp_path, monkeypatch, data):
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="m.gguf is not a readable GGUF") as ei:
        prunelab.load(str(path))
    one_line(ei)
    converted = tmp_path / "cache" / "converted"
    assert not converted.exists() or not any(converted.iterdir())


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unsafe_pickle_refused_in_one_line_and_never_run(base, tmp_path):
    ckpt = variant(base, tmp_path)
    (ckpt / "model.safetensors").unlink()
    marker = tmp_path / "PWNED"
    torch.save({"x": _Evil(str(marker))}, ckpt / "pytorch_model.bin")
    with pytest.raises(PickleRefusedError):
        prunelab.load(str(ckpt))
    with pytest.raises(CorruptCheckpointError, match="pytorch_model.bin .*restricted") as ei:
        prunelab.load(str(ckpt), allow_pickle=True)
    one_line(ei)
    assert not marker.exists()


# ---------------------------------------------------------------- 3. weights-only pickles

def test_pickle_weights_refused_unless_allowed(base, tmp_path):
    ckpt = variant(base, tmp_path)
    sd = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(sd, ckpt / "pytorch_model.bin")
    with pytest.raises(PickleRefusedError) as ei:
        prunelab.load(str(ckpt))
    msg = one_line(ei)
    assert "pytorch_model.bin" in msg and "can run code" in msg and "--allow-pickle" in msg
    lm = prunelab.load(str(ckpt), allow_pickle=True)
    got = lm.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_safetensors_preferred_and_pickle_never_read_beside_it(base, tmp_path):
    ckpt = variant(base, tmp_path)
    (ckpt / "pytorch_model.bin").write_bytes(b"garbage that would fail to unpickle")
    assert prunelab.load(str(ckpt)).adapter.num_blocks == 4


# ---------------------------------------------------------------- 4. flags reach the reference

def test_evaluate_passes_load_flags_to_the_reference(base, tmp_path, monkeypatch):
    ref = variant(base, tmp_path, "ref")
    sd = load_file(ref / "model.safetensors")
    (ref / "model.safetensors").unlink()
    torch.save(sd, ref / "pytorch_model.bin")
    lm = prunelab.load(str(base))
    ids = tiny_tokens(2, 10)
    data = TokenBatches(input_ids=ids, spec="tiny", seqlen=10, samples=2, seed=0, mode="test",
                        total_windows=2, sha256="x")
    with pytest.raises(PickleRefusedError):
        prunelab.evaluate(lm, data, reference=str(ref))
    seen = []
    real = loading.load

    def spy(spec, **kw):
        seen.append(kw)
        return real(spec, **kw)

    monkeypatch.setattr(prunelab.api, "_load", spy)
    res = prunelab.evaluate(lm, data, reference=str(ref), allow_pickle=True,
                            trust_remote_code=True, allow_missing_weights=True)
    assert res["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)  # same weights
    assert res["top1_agreement"] == 1.0
    assert seen[0]["trust_remote_code"] and seen[0]["allow_pickle"]
    assert seen[0]["allow_missing_weights"]


# ---------------------------------------------------------------- 5. leftovers

def test_leftovers_of_dead_writers_are_removed_live_and_foreign_kept(tmp_path):
    me = os.getpid()
    dead_tmp = tmp_path / ".out.tmp-999999-x"
    dead_tmp.mkdir()
    (dead_tmp / "config.json").write_text("{}")
    dead_file = tmp_path / ".out.tmp-999998-abc"
    dead_file.write_text("partial")
    dead_old = tmp_path / ".out.old-999997"
    dead_old.mkdir()
    kept = [tmp_path / f".out.tmp-{me}-x", tmp_path / ".out.tmp-x", tmp_path / ".out.tmp-999996",
            tmp_path / ".other.tmp-999999-x", tmp_path / "out.tmp-999999-x",
            tmp_path / ".out.old-x", tmp_path / ".out.tmp-0-x"]
    for p in kept:
        p.write_text("keep")
    (tmp_path / "out").write_text("{}")
    write_json(tmp_path / "out", {"a": 1}, overwrite=True)
    assert not dead_tmp.exists() and not dead_file.exists() and not dead_old.exists()
    assert all(p.read_text() == "keep" for p in kept)
    assert json.loads((tmp_path / "out").read_text()) == {"a": 1}


def test_dead_writers_backup_is_restored_when_the_output_is_missing(tmp_path):
    """The writer died between moving the old checkpoint aside and moving the new one in:
    the old one is the only complete copy and comes back instead of being deleted."""
    backup = tmp_path / ".ckpt.old-999999"
    backup.mkdir()
    (backup / "config.json").write_text('{"old": true}')
    assert clean_leftovers(tmp_path / "ckpt") == []
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == {"old": True}
    assert not backup.exists()


def test_writers_use_pid_temp_names(tmp_path, monkeypatch):
    seen = []
    real = savemod._install

    def spy(tmp, target, overwrite, kind):
        seen.append(tmp.name)
        real(tmp, target, overwrite, kind)

    monkeypatch.setattr(filesmod, "_install", spy)  # files (write_json)
    monkeypatch.setattr(savemod, "_install", spy)   # checkpoints
    write_json(tmp_path / "r.json", {})
    prunelab.save(wrap(tiny_model("llama"), char_tokenizer()), tmp_path / "ck")
    assert seen[0].startswith(f".r.json.tmp-{os.getpid()}-")
    assert seen[-1].startswith(f".ck.tmp-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "r.json"]


# ---------------------------------------------------------------- 6. overwrite kinds

def test_write_json_never_replaces_a_directory(tmp_path):
    d = tmp_path / "res.json"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError) as ei:
            write_json(d, {"a": 1}, overwrite=overwrite)
        one_line(ei)
    assert (d / "precious.txt").read_text() == "x"


def test_save_overwrite_replaces_only_a_checkpoint(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    afile = tmp_path / "afile"
    afile.write_text("mine")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for target in (afile, folder):
        with pytest.raises(OutputExistsError, match="not a checkpoint") as ei:
            prunelab.save(lm, target, overwrite=True)
        one_line(ei)
    assert afile.read_text() == "mine" and (folder / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    prunelab.save(lm, empty, overwrite=True)  # an empty folder holds nothing to lose
    assert (empty / "config.json").is_file()
    prunelab.save(lm, empty, overwrite=True)  # a checkpoint replaces a checkpoint
    assert (empty / "manifest.json").is_file()


# ---------------------------------------------------------------- 7. one writer at a time

_HOLD = """
import sys
from prunelab.io.lock import output_lock
from prunelab.errors import OutputExistsError
try:
    with output_lock(sys.argv[1]):
        print("acquired")
except OutputExistsError as exc:
    print("refused:", exc)
"""


def _other_process(path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", _HOLD, str(path)], capture_output=True,
                         text=True, env=env, timeout=120)
    return out.stdout.strip()


def test_output_lock_refuses_a_second_process(tmp_path):
    target = tmp_path / "out"
    with output_lock(target) as lock:
        assert lock == tmp_path / ".out.lock" and lock.exists()
        assert _other_process(target) == f"refused: another prunelab process is writing {target}"
        with output_lock(target):  # re-entrant in the holding process
            pass
        # a second open file description in this process is refused too (flock semantics)
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                lockmod.fcntl.flock(fd, lockmod.fcntl.LOCK_EX | lockmod.fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(OutputExistsError, match="another prunelab process"):
            lockmod._acquire(lock, target)
    assert not lock.exists()
    assert _other_process(target) == "acquired"


def test_writers_refused_while_another_process_holds_the_lock(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC)
    target = tmp_path / "res.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time\nfrom prunelab.io.lock import output_lock\n"
         "with output_lock(sys.argv[1]):\n print('held', flush=True)\n sys.stdin.read()",
         str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputExistsError, match="another prunelab process is writing"):
            write_json(target, {"a": 1})
        assert not target.exists()
    finally:
        holder.communicate("", timeout=60)
    write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}


def test_target_appearing_during_the_write_is_never_replaced(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    out = tmp_path / "out"
    real = lm.model.save_pretrained

    def racing_save(path, **kw):
        real(path, **kw)
        out.mkdir()  # another writer (without the lock) finished first
        (out / "config.json").write_text('{"theirs": 1}')

    lm.model.save_pretrained = racing_save
    with pytest.raises(OutputExistsError, match="appeared while") as ei:
        prunelab.save(lm, out)
    one_line(ei)
    assert json.loads((out / "config.json").read_text()) == {"theirs": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_move_noreplace_refuses_files_and_folders(tmp_path):
    for make in (lambda p: p.write_text("t"), lambda p: p.mkdir()):
        src, dst = tmp_path / "src", tmp_path / "dst"
        make(src)
        dst.mkdir()  # even an empty folder is not replaced
        with pytest.raises(FileExistsError):
            move_noreplace(src, dst)
        assert src.exists() and dst.is_dir() and not any(dst.iterdir())
        dst.rmdir()
        move_noreplace(src, dst)
        assert dst.exists() and not src.exists()
        lockmod._remove(dst)


# ---------------------------------------------------------------- 8. durability

def test_save_fsyncs_files_and_folders_before_and_parent_after_the_rename(tmp_path,
                                                                          monkeypatch):
    events = []
    real = os.fsync

    def spy(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append((path, (tmp_path / "ck").exists()))
        return real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name file descriptors")
    monkeypatch.setattr(os, "fsync", spy)
    prunelab.save(wrap(tiny_model("llama"), char_tokenizer()), tmp_path / "ck")
    tmp_events = [(p, done) for p, done in events if ".ck.tmp-" in p]
    synced = {Path(p).name for p, _ in tmp_events}
    assert {"model.safetensors", "config.json", "manifest.json", "tokenizer.json"} <= synced
    assert any(Path(p).name.startswith(".ck.tmp-") for p, _ in tmp_events)  # the folder
    assert not any(done for _, done in tmp_events)  # all before the rename
    assert (str(tmp_path), True) in events  # the parent, after it


def test_write_json_fsyncs_the_file_and_the_parent(tmp_path, monkeypatch):
    events = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    write_json(tmp_path / "a.json", {"x": 1})
    assert Path(events[0]).name.startswith(".a.json.tmp-") and events[-1] == str(tmp_path)


# ---------------------------------------------------------------- 9. cache conversions

def test_publish_once_keeps_a_complete_copy_that_appeared(tmp_path):
    target = tmp_path / "conv"
    target.mkdir()
    (target / "config.json").write_text('{"first": 1}')
    inode = target.stat().st_ino
    mine = tmp_path / ".conv.tmp-1-x"
    mine.mkdir()
    (mine / "config.json").write_text('{"second": 1}')
    publish_once(mine, target, lambda t: (t / "config.json").is_file())
    assert target.stat().st_ino == inode and not mine.exists()
    assert json.loads((target / "config.json").read_text()) == {"first": 1}


def test_publish_once_replaces_an_incomplete_copy(tmp_path):
    target = tmp_path / "conv"
    target.mkdir()
    (target / "partial.bin").write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    publish_once(mine, target, lambda t: (t / "config.json").is_file())
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


def test_gguf_cache_write_never_deletes_a_concurrent_complete_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path))
    target = tmp_path / "converted" / "key"

    def write(tmp):  # another process publishes while this one writes
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"theirs": 1}')
        (tmp / "config.json").write_text('{"mine": 1}')

    conversion.publish_checkpoint(target, write)
    assert json.loads((target / "config.json").read_text()) == {"theirs": 1}
    assert [p.name for p in target.parent.iterdir()] == ["key"]


# ---------------------------------------------------------------- 10. paths before any work

def test_check_output_path_accepts_a_new_path(tmp_path):
    assert check_output_path(tmp_path / "new" / "deeper" / "out") == tmp_path / "new/deeper/out"
    assert not (tmp_path / "new").exists()  # nothing created


def test_check_output_path_refuses_a_file_as_parent(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputWriteError, match="is a file, not a folder") as ei:
        check_output_path(tmp_path / "f" / "sub" / "out")
    one_line(ei)


def test_check_output_path_refuses_an_unwritable_parent(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    with pytest.raises(OutputWriteError, match="no permission to write in") as ei:
        check_output_path(ro / "a" / "out")
    one_line(ei)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_check_output_path_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(OutputWriteError, match="no permission"):
        check_output_path(ro / "out")


@pytest.mark.parametrize("name", [".", "..", "", "CWD", "/"])
def test_check_output_path_refuses_cwd_and_its_ancestors(tmp_path, monkeypatch, name):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(OutputWriteError, match="current folder") as ei:
        check_output_path(str(work) if name == "CWD" else name)
    one_line(ei)
    check_output_path("./sibling")  # a new folder below it is fine


@pytest.mark.parametrize("name", ["out\ud800", "a\x00b"])
def test_check_output_path_refuses_unencodable_names(tmp_path, name):
    with pytest.raises(OutputWriteError) as ei:
        check_output_path(str(tmp_path / name))
    one_line(ei)


def test_check_output_path_refuses_names_too_long_for_temp_names(tmp_path):
    with pytest.raises(OutputWriteError, match="too long"):
        check_output_path(tmp_path / ("x" * 240))
    check_output_path(tmp_path / ("x" * 200))


def test_check_output_path_applies_the_overwrite_rule(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(OutputExistsError):
        check_output_path(tmp_path / "d", kind="checkpoint", overwrite=True)
    with pytest.raises(OutputExistsError):
        check_output_path(tmp_path / "d", kind="file", overwrite=False)
    check_output_path(tmp_path / "d")  # no rule without kind and overwrite


def test_unwritable_output_is_one_line_at_write_time(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputWriteError) as ei:
        write_json(tmp_path / "f" / "a.json", {})
    one_line(ei)
    with pytest.raises(ModelNotFoundError):  # unrelated: loading errors stay as they were
        prunelab.load(str(tmp_path / "nope"))
