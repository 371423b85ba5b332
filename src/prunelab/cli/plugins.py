"""User plugins: Python files or modules imported before a command runs, so that the
methods they register (``@METHODS.register(...)``, ``@RECOVERIES.register(...)``, ...)
are accepted on the command line and listed in ``--help``.

A plugin is named by ``prunelab --plugin FILE.py`` (repeatable) or by the environment
variable ``PRUNELAB_PLUGINS`` (``os.pathsep``-separated files or importable module names).
This module imports nothing heavy: :func:`load` imports the plugins (and so whatever they
import, torch included) only when a command runs; ``--help`` reads the options they add
from the catalog (:mod:`prunelab.cli.catalog`), which is built in a separate process.
"""

from __future__ import annotations

import os
from pathlib import Path

from prunelab.errors import ConfigError
from prunelab.plugins import import_plugin, imported, is_file_spec, module_origin

ENV = "PRUNELAB_PLUGINS"

#: plugins named by --plugin in this process (file paths, resolved)
_cli: list[str] = []
#: plugins already imported in this process (their specs; shared with recipes)
_loaded: set[str] = imported


def from_env() -> list[str]:
    """The plugins of ``$PRUNELAB_PLUGINS`` (files resolved, module names as given)."""
    items = [p.strip() for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]
    return [str(Path(p).expanduser().resolve()) if is_file_spec(p) else p for p in items]


def set_cli(paths: list[str] | None) -> None:
    """Record the ``--plugin`` files of this command line (a missing file is an error)."""
    _cli.clear()
    for p in paths or ():
        path = Path(p).expanduser()
        if not path.is_file():
            raise ConfigError(f"--plugin {p}: no such file")
        _cli.append(str(path.resolve()))


def active() -> list[str]:
    """Every plugin in force: ``$PRUNELAB_PLUGINS`` then ``--plugin``, without repeats."""
    return list(dict.fromkeys([*from_env(), *_cli]))


def fingerprint() -> list[list]:
    """``[spec, size, mtime_ns]`` of each active plugin's file (a module: its source
    file, found without importing it; ``None`` fields when it cannot be found)."""
    out = []
    for spec in active():
        origin = spec if is_file_spec(spec) else module_origin(spec)
        try:
            st = os.stat(origin) if origin else None
        except OSError:
            st = None
        out.append([spec, st.st_size if st else None, st.st_mtime_ns if st else None])
    return out


def load(specs: list[str] | None = None) -> None:
    """Import the active plugins (or ``specs``) once per process; a missing file or an
    error raised while importing one is a :class:`ConfigError` naming the plugin."""
    for spec in active() if specs is None else specs:
        import_plugin(spec)
