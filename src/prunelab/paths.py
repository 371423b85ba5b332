"""Where prunelab keeps converted models and other cached files."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PRUNELAB_CACHE``, else ``$XDG_CACHE_HOME/prunelab``, else ``~/.cache/prunelab``."""
    env = os.environ.get("PRUNELAB_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "prunelab"


def package_file(dist: str, module: str, relpath: str) -> Path | None:
    """Path of ``relpath`` inside an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / relpath
            if cand.is_file():
                return cand
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    target = f"{module}/{relpath}"
    for f in files:
        if str(f).replace("\\", "/").endswith(target):
            cand = Path(f.locate())
            if cand.is_file():
                return cand
    return None
