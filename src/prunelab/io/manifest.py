"""Reading the JSON files of a prunelab checkpoint (``manifest.json``, ``elastic.json``):
a file that is not UTF-8, not JSON, or not of the expected shape (a list where an object
belongs, ``operations`` that are not a list of objects) is a one-line
:class:`~prunelab.errors.CorruptCheckpointError` naming the file, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from prunelab.errors import CorruptCheckpointError


def read_json_file(path: str | Path, kind: type | None = dict):
    """The JSON value in ``path``; ``kind`` (default: an object) is the type it must have."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(
            f"{path} is not valid JSON (truncated or edited? {exc.msg}, line {exc.lineno})"
        ) from None
    if kind is not None and not isinstance(value, kind):
        raise CorruptCheckpointError(
            f"{path} must hold a JSON {_json_kind(kind)}, got a {_json_kind(type(value))}")
    return value


def _json_kind(kind: type) -> str:
    return {dict: "object", list: "list", str: "string", int: "number", float: "number",
            bool: "boolean", type(None): "null"}.get(kind, kind.__name__)


def read_manifest(folder: str | Path) -> dict | None:
    """``folder/manifest.json`` checked (an object; ``operations`` a list of objects;
    ``source_model`` an object), or ``None`` when the folder has none."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return None
    man = read_json_file(path)
    ops = man.get("operations", [])
    if not isinstance(ops, list) or not all(isinstance(op, dict) for op in ops):
        raise CorruptCheckpointError(f"{path}: 'operations' must be a list of objects")
    if "source_model" in man and not isinstance(man["source_model"], dict):
        raise CorruptCheckpointError(f"{path}: 'source_model' must be an object")
    return man


def source_manifest(lm) -> dict | None:
    """``manifest.json`` of the checkpoint folder ``lm`` (a LoadedModel) was loaded from, if
    any (checked as :func:`read_manifest` does)."""
    source = str(getattr(lm, "source", "") or "")
    return read_manifest(Path(source)) if source and Path(source).is_dir() else None
