"""Atomic file writes: refuse unusable or existing outputs, write a file or a folder to a
temporary sibling, make it durable and rename it into place under the output lock
(:mod:`prunelab.io.lock`), so a crash never leaves a half-written output and two writers
never both succeed; an existing target is replaced only with ``overwrite=True``, and even
then only a file replaces a file and a checkpoint a checkpoint prunelab wrote, every file
of it listed by its ``manifest.json`` (a user's file in it, or a checkpoint prunelab did
not write, is refused naming the files it would lose; the old one is removed only after
the new one is in place). :func:`check_output_path` refuses unusable output paths
before any work is done, and an output that is, lies inside or holds one of the command's
inputs (resolved paths, symlinks followed) -- with or without ``overwrite``. Written files
get the usual modes (``0666`` / ``0777`` less the umask), never ``mkstemp``'s ``0600``; a
full disk is one line ("no space left on device") and leaves nothing half-written.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from prunelab.errors import OutputExistsError, OutputWriteError, PrunelabError
from prunelab.io.lock import (
    _remove,
    clean_leftovers,
    fsync_dir,
    move_noreplace,
    output_lock,
    temp_prefix,
)

_CHECKPOINT_MARKERS = ("config.json", "manifest.json")
#: the ``format`` of the manifest prunelab writes beside every checkpoint
MANIFEST_FORMAT = "prunelab-manifest/1"
#: what a checkpoint prunelab wrote before its manifest listed its files may hold
_LEGACY_FILES = ("config.json", "generation_config.json", "manifest.json", "*.safetensors",
                 "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                 "normalizer.json", "*.model", "chat_template.json", "chat_template.jinja",
                 "*preprocessor_config.json", "*processor_config.json",
                 "feature_extractor_config.json", "modeling_prunelab.py", "elastic.json")


def checkpoint_files(folder: Path) -> list[str]:
    """The files (and empty folders) under ``folder``, as sorted relative POSIX paths."""
    out = []
    for root, dirs, files in os.walk(folder):
        base = Path(root)
        out += [(base / f).relative_to(folder).as_posix() for f in files]
        out += [(base / d).relative_to(folder).as_posix() + "/" for d in dirs
                if (base / d).is_symlink() or not any((base / d).iterdir())]
    return sorted(out)


def prunelab_manifest(folder: Path) -> dict | None:
    """The ``manifest.json`` prunelab wrote in ``folder`` (format :data:`MANIFEST_FORMAT`),
    or ``None``."""
    try:
        man = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return man if isinstance(man, dict) and man.get("format") == MANIFEST_FORMAT else None


def foreign_files(folder: Path) -> list[str]:
    """The files of checkpoint ``folder`` that prunelab did not write: those its
    ``manifest.json`` (format :data:`MANIFEST_FORMAT`) does not list (a manifest from before
    the list: those a checkpoint holds, :data:`_LEGACY_FILES`); every file when the folder
    has no prunelab manifest."""
    present = checkpoint_files(folder)
    man = prunelab_manifest(folder)
    if man is None:
        return present
    listed = man.get("files")
    if isinstance(listed, list):
        own = {str(f) for f in listed} | {"manifest.json"}
        return [f for f in present if f not in own]
    return [f for f in present
            if "/" in f or not any(fnmatch.fnmatch(f, pat) for pat in _LEGACY_FILES)]


def _listing(files: list[str], shown: int = 4) -> str:
    more = len(files) - shown
    return ", ".join(files[:shown]) + (f" and {more} more" if more > 0 else "")


def _kind(path: Path) -> str:
    """``missing``, ``file``, ``checkpoint``, ``empty-dir``, ``dir`` or ``other``."""
    if not os.path.lexists(path):
        return "missing"
    if path.is_file():
        return "file"
    if path.is_dir():
        if any((path / m).is_file() for m in _CHECKPOINT_MARKERS):
            return "checkpoint"
        try:
            return "dir" if any(path.iterdir()) else "empty-dir"
        except OSError:  # unreadable: treat as holding something
            return "dir"
    return "other"


def _check_target(path: Path, overwrite: bool, kind: str) -> None:
    """Refuse an existing ``path`` unless ``overwrite``, and even then unless it is of the
    same ``kind`` (``"file"``: a file; ``"checkpoint"``: a checkpoint or an empty folder)."""
    found = _kind(path)
    if found == "missing":
        return
    if kind == "file" and found not in ("file", "missing"):
        raise OutputExistsError(f"{path} is a {_NAMES[found]}, not a file: name a file")
    if not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")
    if kind == "file" and found != "file":
        raise OutputExistsError(f"{path} is a {_NAMES[found]}; --overwrite replaces a file "
                                "only with a file: remove it yourself or choose another path")
    if kind == "checkpoint" and found not in ("checkpoint", "empty-dir"):
        raise OutputExistsError(f"{path} is a {_NAMES[found]}, not a checkpoint (no config.json "
                                "or manifest.json); --overwrite replaces only a checkpoint: "
                                "remove it yourself or choose another path")
    if kind == "checkpoint" and found == "checkpoint":
        foreign = foreign_files(path)
        if foreign:
            what = ("holds files prunelab did not write" if prunelab_manifest(path)
                    else "is not a checkpoint prunelab wrote (no prunelab manifest.json)")
            raise OutputExistsError(
                f"{path} {what}: --overwrite would lose {_listing(foreign)}; it replaces "
                "only the files a prunelab manifest lists: move them away or choose "
                "another path")


_NAMES = {"file": "file", "checkpoint": "checkpoint", "empty-dir": "folder",
          "dir": "folder", "other": "special file"}


@contextmanager
def _os_errors(path: Path) -> Iterator[None]:
    """Turn an OS error while writing ``path`` into a one-line OutputWriteError."""
    try:
        yield
    except PrunelabError:
        raise
    except (OSError, UnicodeError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OutputWriteError(f"cannot write {path}: no space left on device (nothing "
                                   "was left half-written)") from exc
        raise OutputWriteError(f"cannot write {path}: {_first_line(exc)}") from exc


# ---------------------------------------------------------------- modes

def _umask() -> int:
    """The process's umask (read without changing it where /proc tells it)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def usual_mode(folder: bool = False) -> int:
    """The mode a plain ``open`` / ``mkdir`` gives: ``0666`` (``0777`` for a folder) less
    the umask -- not ``mkstemp``'s ``0600`` / ``mkdtemp``'s ``0700``."""
    return (0o777 if folder else 0o666) & ~_umask()


def usual_modes(root: Path) -> None:
    """Give ``root`` and everything below it (not following links) the usual modes. A file
    with other hard links (a source shard a streamed save linked into its checkpoint) keeps
    its mode: it is shared with another path, maybe not ours to change."""
    root = Path(root)
    fmode, dmode = usual_mode(), usual_mode(folder=True)
    if not root.is_dir() or root.is_symlink():
        os.chmod(root, fmode)
        return
    for dirpath, dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p) and os.stat(p).st_nlink == 1:
                os.chmod(p, fmode)
        for name in dirs:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, dmode)
    os.chmod(root, dmode)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def _install(tmp: Path, target: Path, overwrite: bool, kind: str) -> None:
    """Move the complete, fsynced ``tmp`` to ``target`` (caller holds the output lock).

    Without ``overwrite`` the move never replaces anything, even a target that appeared
    while ``tmp`` was being written. With it, a file replaces a file atomically and a
    checkpoint replaces a checkpoint through a backup removed only after the move.
    """
    if not overwrite or not os.path.lexists(target):
        try:
            move_noreplace(tmp, target)
        except FileExistsError:
            raise OutputExistsError(f"{target} appeared while this process was writing it; "
                                    "it was left as it is") from None
    else:
        _check_target(target, True, kind)
        if kind == "file":
            os.replace(tmp, target)
        else:
            backup = target.with_name(f".{target.name}.old-{os.getpid()}")
            if os.path.lexists(backup):
                _remove(backup)
            os.rename(target, backup)
            try:
                os.rename(tmp, target)
            except OSError:
                os.rename(backup, target)
                raise
            fsync_dir(target.parent)
            _remove(backup)
    fsync_dir(target.parent)


# ---------------------------------------------------------------- checks before work

_TEMP_SUFFIX_BYTES = 32  # ".NAME.tmp-<pid>-<random>" and ".NAME.lock" add at most this


def check_output_path(path: str | Path, *, kind: str | None = None,
                      overwrite: bool | None = None,
                      inputs: Mapping[str, Any] | None = None) -> Path:
    """Refuse, in one line (:class:`~prunelab.errors.OutputWriteError`), an output path
    that cannot be written -- before any work is done: a name the file system cannot
    encode (or with a NUL), a name too long for the temp names, ``.``/``..``/the current
    folder or one of its ancestors, a parent that is a file, a parent folder without
    write permission. With ``kind`` (``"file"`` or ``"checkpoint"``) and ``overwrite``
    given, also apply the writers' existing-output rule. ``inputs`` (label -> path, e.g.
    ``{"--model": spec}``; entries that name nothing on disk are skipped) are what the same
    command reads: an output equal to one, inside one or holding one is refused whatever
    ``overwrite`` says (:func:`check_not_input`). Returns ``Path(path)``.
    """
    p = Path(path)
    text = str(path)
    enc = sys.getfilesystemencoding()
    if "\0" in text:
        raise OutputWriteError(f"output path {text!r} contains a NUL character")
    try:
        text.encode(enc)
    except UnicodeEncodeError:
        raise OutputWriteError(f"output path {text!r} cannot be encoded in the file system's "
                               f"encoding ({enc}): choose another name") from None
    full = Path(os.path.abspath(p))
    if Path.cwd().resolve().is_relative_to(full.resolve()):
        raise OutputWriteError(f"output path {text!r} is the current folder or one of its "
                               "parents: name a new file or folder")
    anc, below = full.parent, [full.name]
    while not os.path.lexists(anc) and anc != anc.parent:
        anc, below = anc.parent, [anc.name, *below]
    if not anc.is_dir():
        raise OutputWriteError(f"cannot write {text}: {anc} is a file, not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputWriteError(f"cannot write {text}: no permission to write in {anc}")
    try:
        limit = os.pathconf(anc, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    for i, name in enumerate(below):
        extra = _TEMP_SUFFIX_BYTES if i == len(below) - 1 else 0
        if len(name.encode(enc)) + extra > limit:
            raise OutputWriteError(f"output name {name[:40]!r}... is too long for this file "
                                   f"system ({limit} bytes per name, temp names included)")
    if inputs:
        check_not_input(p, inputs)
    if kind is not None and overwrite is not None:
        _check_target(p, overwrite, kind)
    return p


def _resolved(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def check_not_input(path: str | Path, inputs: Mapping[str, Any] | Iterable,
                    what: str = "input") -> None:
    """Refuse (one line, :class:`~prunelab.errors.OutputWriteError`) an output ``path``
    that is one of ``inputs``, lies inside one or holds one, comparing resolved paths
    (symlinks followed). ``inputs``: label -> path (or paths), or ``(label, path)`` pairs;
    ``None`` and specs that name nothing on disk (a hub id, an embedded model's name) are
    skipped. ``what="output"``: ``inputs`` are the command's other outputs, compared
    whether they exist yet or not (two outputs of one command may not overlap)."""
    out = _resolved(path)
    items = inputs.items() if isinstance(inputs, Mapping) else inputs
    for label, value in items:
        values = value if isinstance(value, (list, tuple, set)) else [value]
        for v in values:
            if v is None or str(v) == "" or (
                    what == "input" and not os.path.lexists(os.path.abspath(v))):
                continue
            src = _resolved(v)
            if out == src:
                how = "is"
            elif out.is_relative_to(src):
                how = "lies inside"
            elif src.is_relative_to(out):
                how = "holds"
            else:
                continue
            if what != "input":
                raise OutputWriteError(f"output {path} {how} the other output {label} {v}: "
                                       "one command's outputs may not overlap; choose "
                                       "another path")
            raise OutputWriteError(f"output {path} {how} the input {label} {v}: an output "
                                   "may never be an input of the same command (even with "
                                   "--overwrite); choose another path")


# ---------------------------------------------------------------- writers

def write_json(path: str | Path, obj: Any, overwrite: bool = False) -> Path:
    """Write ``obj`` as indented JSON atomically and durably (fsynced temp file renamed
    into place under the output lock). ``overwrite`` replaces a file, never a folder."""
    with atomic_file(path, overwrite) as tmp, open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, default=_json_default)
        fh.write("\n")
    return Path(path)


@contextmanager
def atomic_file(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` for a writer that takes a path (e.g. the ``gguf``
    package's, or :func:`write_json` / :func:`write_text`); when the block ends it is
    fsynced and moved onto ``path`` (an existing file replaced only with ``overwrite``, a
    folder never); on any error,
    Ctrl-C included, it is removed and ``path`` is left as it was."""
    path = Path(path)
    _check_target(path, overwrite, "file")
    with _os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(path):
            clean_leftovers(path)
            _check_target(path, overwrite, "file")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path))
            os.fchmod(fd, usual_mode())
            os.close(fd)
            try:
                yield Path(tmp)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                _install(Path(tmp), path, overwrite, "file")
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(tmp)


def write_text(path: str | Path, text: str, overwrite: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably, like :func:`write_json`:
    an existing file is replaced only with ``overwrite``, a folder never; a failure (a full
    disk included) is one line and leaves nothing behind."""
    with atomic_file(path, overwrite) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    return Path(path)


def _json_default(obj):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)
