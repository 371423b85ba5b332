"""Importing a user's plugin: a Python file or an importable module whose import registers
methods, probes, recoveries, scores or presses (``@METHODS.register(...)``, ...).

Used by the CLI (``--plugin``, ``$PRUNELAB_PLUGINS``: :mod:`prunelab.cli.plugins`) and by
recipes (their top-level ``plugins:``). Errors are one-line :class:`ConfigError` naming the
plugin: a missing file or module, whatever the plugin raised while importing, and an exit
at import (``sys.exit(0)`` included: a plugin that ends the process would make the command
succeed with nothing done). Only Ctrl-C (``KeyboardInterrupt``) goes through as it is.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from prunelab.errors import ConfigError

#: plugins imported in this process (file paths resolved, module names as given)
imported: set[str] = set()


def is_file_spec(spec: str) -> bool:
    """A plugin spec names a file (``x.py``, or any path with a separator), else a module."""
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def import_plugin(spec: str) -> None:
    """Import plugin ``spec`` once per process (see the module docstring for errors)."""
    if spec in imported:
        return
    try:
        if is_file_spec(spec):
            _import_file(spec)
        else:
            importlib.import_module(spec)
    except ConfigError:
        raise
    except FileNotFoundError as exc:
        raise ConfigError(f"plugin {spec}: no such file") from exc
    except ModuleNotFoundError as exc:
        if not is_file_spec(spec) and exc.name == spec.split(".")[0]:
            raise ConfigError(f"plugin {spec}: no such module") from exc
        raise ConfigError(f"cannot load plugin {spec}: {type(exc).__name__}: {exc}") from exc
    except SystemExit as exc:  # sys.exit() / exit() at import: never the command's exit
        raise ConfigError(f"cannot load plugin {spec}: it exits at import "
                          f"(SystemExit({exc.code!r}))") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # anything else the user's file raises at import
        raise ConfigError(f"cannot load plugin {spec}: {type(exc).__name__}: {exc}") from exc
    imported.add(spec)


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


def source_digest(spec: str) -> str | None:
    """sha256 (16 hex digits) of a plugin's source file; ``None`` when it cannot be found."""
    origin = spec if is_file_spec(spec) else module_origin(spec)
    try:
        return hashlib.sha256(Path(origin).read_bytes()).hexdigest()[:16] if origin else None
    except OSError:
        return None


def module_origin(name: str) -> str | None:
    """The source file of module ``name``, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None

