"""Pruning methods: one verb, dispatched on a typed config.

``prunelab.prune(model, Depth(remove=6, probe="block-influence", recovery="foldable"),
data)``. Each method is a frozen dataclass config plus a handler registered in
:data:`PRUNERS`.
"""

from __future__ import annotations

from collections.abc import Callable

from prunelab.prune.depth import Depth

PRUNERS: dict[type, Callable] = {}


def _register_defaults() -> None:
    from prunelab.prune.surgery import prune_depth

    PRUNERS[Depth] = prune_depth


_register_defaults()

__all__ = ["PRUNERS", "Depth"]
