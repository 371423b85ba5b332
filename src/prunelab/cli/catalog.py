"""A catalog of the registries' metadata, so that ``--help`` lists the registered pieces
and their options without importing them (their modules import torch).

The catalog holds, for each kind of piece the CLI offers (:data:`KINDS`), every registered
name with the first line of its docstring and its user-facing fields (flat option name,
flag, type, default, help, ...; see :func:`field_entry`). It is built by importing the
registries (:func:`build`) and cached as JSON under ``prunelab.paths.cache_dir()/cli-catalog``,
keyed by a fingerprint of the package's source files (path, size, mtime) and of the active
plugin files (:mod:`prunelab.cli.plugins`): editing a config, adding a method to the package
or changing a plugin makes a new key, and the next ``--help`` rebuilds it in a child process
(so the process printing the help never imports torch). A command that runs, or any process
where torch is already loaded, builds it from the live registries instead (:func:`get`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path

from prunelab.cli import plugins
from prunelab.errors import ConfigError
from prunelab.registry import field_metadata

VERSION = 3
#: the kinds of piece the catalog lists, in the order --help shows them
KINDS = ("strategies", "recoveries", "width_scores", "width_allocations", "sparsity_methods",
         "sparsity_allocations", "probes", "factor_methods", "gates", "moe", "elastic", "heal",
         "presses")
_KEEP = 8  # cached catalogs kept (one per package / plugin state)


def live_registries() -> dict[str, dict[str, type]]:
    """``{kind: {name: config class}}`` from the imported registries (imports torch).
    The one-config commands (``prune gates`` / ``moe`` / ``elastic``, ``heal``) are kinds
    of one piece: the class registered under the method's name (a plugin re-registering
    it with a subclass changes the options), and :class:`~prunelab.heal.HealConfig`."""
    import prunelab.heal
    from prunelab.inference import PRESSES
    from prunelab.probes import PROBES
    from prunelab.pruning import (
        ALLOCATIONS,
        METHODS,
        RECOVERIES,
        STRATEGIES,
        WIDTH_ALLOCATIONS,
        WIDTH_SCORES,
        factor_methods,
        sparsity_methods,
    )

    def of(reg) -> dict:
        return {n: reg.get(n) for n in reg.names()}

    return {"strategies": of(STRATEGIES), "recoveries": of(RECOVERIES),
            "width_scores": of(WIDTH_SCORES), "width_allocations": of(WIDTH_ALLOCATIONS),
            "sparsity_methods": sparsity_methods(), "sparsity_allocations": of(ALLOCATIONS),
            "probes": of(PROBES), "factor_methods": factor_methods(),
            "gates": {"gates": METHODS.get("gates")},
            "moe": {"prunepath": METHODS.get("prunepath")},
            "elastic": {"elastic": METHODS.get("elastic")},
            "heal": {"heal": prunelab.heal.HealConfig}, "presses": of(PRESSES)}


def _doc(cls) -> str:
    lines = (getattr(cls, "__doc__", None) or "").strip().splitlines()
    return lines[0].strip().rstrip(".") if lines else ""


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: the field is offered through --set only
        return {}


def _metadata(cls, f: dataclasses.Field) -> dict:
    """A field's metadata; a field overridden without ``help`` keeps its base's."""
    return field_metadata(cls, f)


def type_spec(tp) -> tuple[str, bool, list | None]:
    """``(kind, optional, choices)`` of an annotation: kind ``bool`` / ``int`` / ``float``
    / ``str`` / ``tuple`` (a comma-separated list on the command line) or ``other`` (not
    a command-line option); ``Literal[...]`` gives the choices."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        if len(rest) != 1:
            return "other", optional, None
        tp = rest[0]
    if typing.get_origin(tp) is typing.Literal:
        choices = list(typing.get_args(tp))
        kinds = {type(c).__name__ for c in choices}
        kind = kinds.pop() if len(kinds) == 1 and kinds <= {"int", "float", "str"} else "str"
        return kind, optional, [str(c) for c in choices] if kind == "str" else choices
    if tp in (bool, int, float, str):
        return tp.__name__, optional, None
    if tp in (tuple, list) or typing.get_origin(tp) in (tuple, list):
        return "tuple", optional, None
    return "other", optional, None


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(
            isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return None


def field_entry(cls, f: dataclasses.Field, hints: dict) -> dict:
    """One field of a registered config as the catalog lists it."""
    from prunelab.pruning.options import option_name

    meta = _metadata(cls, f)
    kind, optional, choices = type_spec(hints.get(f.name, f.type))
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None
    flat = option_name(f.name, meta)
    rng = meta.get("range")
    return {"name": f.name, "flat": flat,
            "flag": meta.get("flag") or "--" + flat.replace("_", "-"),
            "kind": kind, "optional": optional, "choices": choices,
            "default": _jsonable(default), "help": str(meta.get("help", "")),
            "negate": bool(meta.get("negate")), "range": list(rng) if rng else None,
            "budget": meta.get("budget"), "aliases": list(meta.get("aliases", ())),
            "toggle": bool(meta.get("toggle"))}


def entry(name: str, cls) -> dict:
    """A registered name, its one-line doc, its fields (and a width score's units)."""
    out: dict = {"name": name, "doc": _doc(cls), "fields": []}
    if cls is None or not dataclasses.is_dataclass(cls):
        return out
    hints = _hints(cls)
    out["fields"] = [field_entry(cls, f, hints) for f in dataclasses.fields(cls)
                     if f.init and not f.name.startswith("_")]
    units = getattr(cls, "units", None)
    if isinstance(units, (tuple, list, set, frozenset)):
        out["units"] = sorted(units, key=str)
    return out


def build() -> dict:
    """The catalog of the live registries (imports them, and so torch)."""
    regs = live_registries()
    return {"version": VERSION,
            "kinds": {k: [entry(n, c) for n, c in regs[k].items()] for k in KINDS}}


def fingerprint() -> str:
    """A key over the package's ``.py`` files (path, size, mtime), the Python version,
    the catalog format and the active plugins' files."""
    root = Path(__file__).resolve().parent.parent
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                st = os.stat(os.path.join(dirpath, name))
                files.append([os.path.relpath(os.path.join(dirpath, name), root), st.st_size,
                              st.st_mtime_ns])
    key = {"version": VERSION, "python": sys.version, "root": str(root), "files": files,
           "plugins": plugins.fingerprint()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    from prunelab.paths import cache_dir

    return cache_dir() / "cli-catalog" / f"{key}.json"


def get(live: bool | None = None) -> dict:
    """The catalog: from the live registries when ``live`` (default: when torch is
    already imported; the active plugins are imported first), else the cached one for
    the current fingerprint, rebuilt in a child process when missing or stale."""
    if live is None:
        live = "torch" in sys.modules
    if live:
        plugins.load()
        return build()
    key = fingerprint()
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("version") == VERSION and data.get("key") == key:
            return data
    except (OSError, ValueError):
        pass
    data = _build_in_child()
    if data is None:  # the child failed: build here, so that its error is raised here
        plugins.load()
        data = build()
    data["key"] = key
    _store(path, data)
    return data


def _build_in_child() -> dict | None:
    """:func:`build` with the active plugins in a fresh interpreter; ``None`` on failure."""
    src = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "catalog.json"
        code = ("import json, sys; from prunelab.cli import catalog, plugins; "
                "plugins.load(json.loads(sys.argv[1])); "
                "open(sys.argv[2], 'w').write(json.dumps(catalog.build()))")
        try:
            res = subprocess.run([sys.executable, "-c", code, json.dumps(plugins.active()),
                                  str(out)], env=env, capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError):
            return None
        if res.returncode != 0 or not out.is_file():
            return None
        for line in res.stderr.decode(errors="replace").splitlines():
            if line.startswith("prunelab: warning: "):  # e.g. a plugin replacing a piece
                print(line, file=sys.stderr)
        return json.loads(out.read_text())


def _store(path: Path, data: dict) -> None:
    """Write the catalog atomically and keep the :data:`_KEEP` newest (an unwritable cache
    folder only costs the rebuild next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
        old = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
        for stale in old[:-_KEEP]:
            stale.unlink(missing_ok=True)
    except OSError:
        pass


def names(catalog: dict, kind: str) -> list[str]:
    if kind not in catalog.get("kinds", {}):
        raise ConfigError(f"the CLI catalog has no {kind!r}")
    return [e["name"] for e in catalog["kinds"][kind]]
