"""Offline multiple-choice tasks from local JSONL files (no hub, air-gapped clusters).

Schema, one item per line (UTF-8; blank lines are skipped)::

    {"context": "Question: What is 2+2?\\nAnswer:", "choices": ["3", "4"], "gold": 1,
     "id": "q1"}

- ``context`` (string): the prompt, exactly as the model reads it (may be empty: then the
  continuation is scored after the BOS/EOS token, as lm-eval does);
- ``choices`` (list of >= 2 non-empty strings): each is scored as the continuation
  ``delimiter + choice``;
- ``gold`` (int): index of the correct choice, ``0 <= gold < len(choices)``;
- ``id`` (optional, any JSON scalar): reported with per-item results; default the line number;
- ``delimiter`` (optional string, default ``" "``): lm-eval's ``target_delimiter``.

Metrics are lm-eval's: ``acc`` (highest summed log-likelihood) and ``acc_norm`` (highest
log-likelihood per character of the choice, the delimiter not counted).
"""

from __future__ import annotations

import json
from pathlib import Path

from prunelab.errors import ConfigError
from prunelab.eval.tasks.scorer import Item

_KEYS = {"context", "choices", "gold", "id", "delimiter"}


def _item(path: Path, lineno: int, row) -> Item:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    unknown = sorted(set(row) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} "
                          f"(expected context, choices, gold, optional id, delimiter)")
    for key in ("context", "choices", "gold"):
        if key not in row:
            raise ConfigError(f"{where}: missing key {key!r}")
    ctx, choices, gold = row["context"], row["choices"], row["gold"]
    delim = row.get("delimiter", " ")
    if not isinstance(ctx, str):
        raise ConfigError(f"{where}: 'context' must be a string")
    if not isinstance(delim, str):
        raise ConfigError(f"{where}: 'delimiter' must be a string")
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise ConfigError(f"{where}: 'choices' must be a list of at least 2 non-empty strings")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ConfigError(f"{where}: 'gold' must be an integer in [0, {len(choices) - 1}], "
                          f"got {gold!r}")
    uid = row.get("id", lineno)
    return Item(id=str(uid), requests=tuple((ctx, delim + c) for c in choices), gold=gold,
                norm_lengths=tuple(len(c) for c in choices))


def read_jsonl(path: str | Path, limit: int | None = None) -> list[Item]:
    """Items of a JSONL task file (schema in this module's docstring); one-line
    :class:`ConfigError` naming the file and line on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")
    items: list[Item] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if limit is not None and len(items) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte "
                                  f"{exc.start} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            items.append(_item(path, lineno, row))
    if not items:
        raise ConfigError(f"task file {path} has no items")
    return items


def jsonl_files(spec: str) -> dict[str, Path]:
    """``{task name: file}`` for a ``.jsonl`` file (name = its stem) or a folder (every
    ``*.jsonl`` in it, sorted)."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ConfigError(f"task folder {path} has no *.jsonl files")
        return {f.stem: f for f in files}
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ConfigError(f"task file {path} does not exist")
        return {path.stem: path}
    raise ConfigError(f"{spec} is neither a .jsonl file nor a folder")
