"""Pruning methods: one verb, dispatched on a typed config.

``prunelab.prune(model, Depth(remove=6, probe="block-influence", recovery="foldable"),
data)``. Each method is a frozen dataclass config plus a handler registered in
:data:`PRUNERS`.
"""

from __future__ import annotations

from collections.abc import Callable

from prunelab.pruning.depth import Depth
from prunelab.pruning.width.config import Width

PRUNERS: dict[type, Callable] = {}


def _register_defaults() -> None:
    from prunelab.pruning.sparsity.config import SparsityConfig
    from prunelab.pruning.sparsity.execute import prune_sparsity
    from prunelab.pruning.surgery import prune_depth
    from prunelab.pruning.width.execute import prune_width

    PRUNERS[Depth] = prune_depth
    PRUNERS[SparsityConfig] = prune_sparsity
    PRUNERS[Width] = prune_width


def handler_for(config) -> Callable | None:
    """The handler registered for ``type(config)`` or its nearest base class."""
    for cls in type(config).__mro__:
        if cls in PRUNERS:
            return PRUNERS[cls]
    return None


_register_defaults()

from prunelab.pruning.sparsity.config import (  # noqa: E402
    Magnitude,
    Owl,
    Pals,
    QKWanda,
    Ramp,
    Rose,
    SparseGPT,
    Uniform,
    Wanda,
)

__all__ = ["PRUNERS", "Depth", "Magnitude", "Owl", "Pals", "QKWanda", "Ramp", "Rose",
           "SparseGPT", "Uniform", "Wanda", "Width", "handler_for"]
