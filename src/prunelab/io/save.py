"""Atomic checkpoint and JSON writes, and the manifest that explains every output.

A checkpoint is written to a temporary directory next to the target (``.NAME.tmp-<pid>-*``),
fsynced and renamed into place under the output lock (:mod:`prunelab.io.lock`), so a crash
never leaves a half-written output and two writers never both succeed; an existing target
is refused unless ``overwrite=True``, and even then only a file replaces a file and a
checkpoint a checkpoint (the old one is removed only after the new one is in place).
:func:`check_output_path` refuses unusable output paths before any work is done.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from prunelab.errors import OutputExistsError, OutputWriteError, PrunelabError
from prunelab.io.lock import (
    _remove,
    clean_leftovers,
    fsync_dir,
    fsync_tree,
    move_noreplace,
    output_lock,
    temp_prefix,
)
from prunelab.models.size import model_size


def versions() -> dict[str, str]:
    import torch
    import transformers

    from prunelab._version import __version__

    return {"prunelab": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def build_manifest(lm, *, operation: str | None = None, config: dict | None = None,
                   data: Any = None, before: dict | None = None,
                   metrics: dict | None = None, extra: dict | None = None) -> dict:
    """The manifest of a prunelab output (plain JSON-serialisable dict).

    Records the source model, what was done (``lm.history`` plus ``operation``), the
    calibration data (spec, samples, seqlen, seed, sha256), library versions, parameter
    counts and bytes before/after, and metrics.
    """
    after = model_size(lm.model)
    history = list(getattr(lm, "history", []))
    if operation:
        history.append({"operation": operation, "config": config or {}})
    manifest = {
        "format": "prunelab-manifest/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source_model": {"spec": lm.spec, "source": lm.source,
                         "model_type": lm.model.config.model_type,
                         "family": lm.adapter.family},
        "operations": history,
        "data": data.to_dict() if hasattr(data, "to_dict") else data,
        "size_before": before or getattr(lm, "size_before", None) or after,
        "size_after": after,
        "num_blocks": lm.adapter.num_blocks,
        "metrics": metrics or {},
        "versions": versions(),
    }
    if extra:
        manifest.update(extra)
    return manifest


_CHECKPOINT_MARKERS = ("config.json", "manifest.json")


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
    if not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")
    if kind == "file" and found != "file":
        raise OutputExistsError(f"{path} is a {_NAMES[found]}; --overwrite replaces a file "
                                "only with a file: remove it yourself or choose another path")
    if kind == "checkpoint" and found not in ("checkpoint", "empty-dir"):
        raise OutputExistsError(f"{path} is a {_NAMES[found]}, not a checkpoint (no config.json "
                                "or manifest.json); --overwrite replaces only a checkpoint: "
                                "remove it yourself or choose another path")


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
        raise OutputWriteError(f"cannot write {path}: {_first_line(exc)}") from exc


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
                      overwrite: bool | None = None) -> Path:
    """Refuse, in one line (:class:`~prunelab.errors.OutputWriteError`), an output path
    that cannot be written -- before any work is done: a name the file system cannot
    encode (or with a NUL), a name too long for the temp names, ``.``/``..``/the current
    folder or one of its ancestors, a parent that is a file, a parent folder without
    write permission. With ``kind`` (``"file"`` or ``"checkpoint"``) and ``overwrite``
    given, also apply the writers' existing-output rule. Returns ``Path(path)``.
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
    if kind is not None and overwrite is not None:
        _check_target(p, overwrite, kind)
    return p


# ---------------------------------------------------------------- writers

def write_json(path: str | Path, obj: Any, overwrite: bool = False) -> Path:
    """Write ``obj`` as indented JSON atomically and durably (fsynced temp file renamed
    into place under the output lock). ``overwrite`` replaces a file, never a folder."""
    path = Path(path)
    _check_target(path, overwrite, "file")
    with _os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(path):
            clean_leftovers(path)
            _check_target(path, overwrite, "file")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path))
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(obj, fh, indent=2, default=_json_default)
                    fh.write("\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                _install(Path(tmp), path, overwrite, "file")
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
    return path


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


def save(lm, out_dir: str | Path, manifest: dict | None = None, overwrite: bool = False) -> Path:
    """Save ``lm`` as a plain ``transformers`` checkpoint plus ``manifest.json``.

    The config is brought in line with the (pruned) shapes first; shapes a plain config
    cannot describe raise :class:`~prunelab.errors.UnsupportedOperationError`, except
    after prunelab's width pruning (per-block widths, head counts a family derives from
    ``hidden_size``): those, like models with linear bridges (ghost / lra depth
    recovery) get a modeling file and ``auto_map`` and load with
    ``trust_remote_code=True`` (see :mod:`prunelab.io.remote`).
    """
    from prunelab.io.remote import has_bridges, has_custom_modules

    out = Path(out_dir)
    _check_target(out, overwrite, "checkpoint")
    # per-block widths from prunelab's width pruning: the modeling file resizes the
    # projections at load; other shapes a plain config cannot hold are refused
    widths = bool(lm.adapter.vanilla_problems()) and (any(
        op.get("operation") == "prune-width" for op in getattr(lm, "history", []))
        or getattr(lm.model.config, "prunelab_widths", None) is not None)
    if widths:
        lm.model.config.num_hidden_layers = lm.adapter.num_blocks
    else:
        lm.adapter.sync_config()
    remote = has_bridges(lm.model) or has_custom_modules(lm.model) or widths
    if getattr(lm.model, "hf_quantizer", None) is not None:
        raise PrunelabError("a quantized (GGUF) model cannot be saved; load it by prunelab "
                            "spec so it is converted to a float checkpoint first")
    with _os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(out):
            clean_leftovers(out)
            _check_target(out, overwrite, "checkpoint")
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out)))
            try:
                lm.model.save_pretrained(tmp)
                if lm.tokenizer is not None:
                    lm.tokenizer.save_pretrained(tmp)
                if getattr(lm, "elastic_ranking", None) is not None:  # elastic checkpoint
                    from prunelab.pruning.elastic.method import ranking_to_save
                    if (ranking := ranking_to_save(lm)) is not None:
                        write_json(tmp / "elastic.json", ranking)
                finish_checkpoint(lm, tmp, out, manifest, remote, overwrite)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return out


def finish_checkpoint(lm, tmp: Path, out: Path, manifest: dict | None, remote: bool,
                      overwrite: bool, **extra) -> None:
    """Write the manifest (plus ``extra`` fields) and the remote code into the temporary
    checkpoint folder ``tmp``, make it durable and rename it into place at ``out``."""
    from prunelab.io.remote import load_hint, write_remote_code

    man = dict(manifest) if manifest is not None else build_manifest(lm)
    man.update(extra)
    if remote:
        man["remote_code"] = write_remote_code(lm.model, tmp)
    man["loads_with"] = (load_hint(lm.model) if remote
                         else "plain transformers (no remote code)")
    write_json(tmp / "manifest.json", man)
    os.chmod(tmp, 0o755)
    fsync_tree(tmp)
    _install(tmp, out, overwrite, "checkpoint")
