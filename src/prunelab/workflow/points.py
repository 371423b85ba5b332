"""A point of a study: its ``key`` (its folder ``OUT/points/<key>``) and the ``payload`` it
depends on; run by :mod:`prunelab.workflow.executor`, here or on Ray
(:mod:`prunelab.workflow.ray_backend`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError

_KEY = re.compile(r"^[A-Za-z0-9._=+-]{1,120}$")


@dataclass(frozen=True)
class Point:
    """One unit of work: ``key`` names its folder, ``payload`` is what it depends on."""

    key: str
    payload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _KEY.match(self.key) or set(self.key) == {"."}:
            raise ConfigError(f"point key {self.key!r} must be 1-120 characters of "
                              "letters, digits and . _ = + -, not only dots")


def point_dir(out: Path, key: str) -> Path:
    return Path(out) / "points" / key
