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

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from prunelab.errors import ConfigError

ENV = "PRUNELAB_PLUGINS"

#: plugins named by --plugin in this process (file paths, resolved)
_cli: list[str] = []
#: plugins already imported in this process (their specs)
_loaded: set[str] = set()


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def from_env() -> list[str]:
    """The plugins of ``$PRUNELAB_PLUGINS`` (files resolved, module names as given)."""
    items = [p.strip() for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]
    return [str(Path(p).expanduser().resolve()) if _is_file(p) else p for p in items]


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
        origin = spec if _is_file(spec) else _module_origin(spec)
        try:
            st = os.stat(origin) if origin else None
        except OSError:
            st = None
        out.append([spec, st.st_size if st else None, st.st_mtime_ns if st else None])
    return out


def _module_origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def load(specs: list[str] | None = None) -> None:
    """Import the active plugins (or ``specs``) once per process; a missing file or an
    error raised while importing one is a :class:`ConfigError` naming the plugin."""
    for spec in active() if specs is None else specs:
        if spec in _loaded:
            continue
        try:
            if _is_file(spec):
                _import_file(spec)
            else:
                importlib.import_module(spec)
        except ConfigError:
            raise
        except FileNotFoundError as exc:
            raise ConfigError(f"plugin {spec}: no such file") from exc
        except ModuleNotFoundError as exc:
            if not _is_file(spec) and exc.name == spec.split(".")[0]:
                raise ConfigError(f"plugin {spec}: no such module") from exc
            raise ConfigError(f"cannot load plugin {spec}: {type(exc).__name__}: {exc}") \
                from exc
        except Exception as exc:  # anything the user's file raises at import
            raise ConfigError(f"cannot load plugin {spec}: {type(exc).__name__}: {exc}") \
                from exc
        _loaded.add(spec)


def _import_file(path: str) -> None:
    if not Path(path).is_file():
        raise FileNotFoundError(path)
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    name = f"prunelab_plugin_{Path(path).stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plugin {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
