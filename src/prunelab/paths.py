"""Where prunelab keeps converted models and other cached files."""

from __future__ import annotations

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
