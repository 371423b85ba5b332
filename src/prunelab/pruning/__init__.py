"""Pruning methods: one verb, dispatched on a typed config.

``prunelab.prune(model, Depth(remove=6, probe="block-influence", recovery="foldable"),
data)``. Each method is a frozen dataclass config registered in :data:`METHODS` plus a
:class:`~prunelab.pruning.base.Pruner` registered for its type (see
:mod:`prunelab.pruning.base`).
"""

from __future__ import annotations

from prunelab.pruning.base import (
    METHODS,
    DictReport,
    MethodReport,
    Pruner,
    PruneReport,
    config_from_dict,
    pruner_for,
    register_pruner,
)
from prunelab.pruning.depth import Depth
from prunelab.pruning.sparsity import pruner as _sparsity_pruner  # noqa: F401 - registers
from prunelab.pruning.sparsity.config import (
    ALLOCATIONS,
    Owl,
    Pals,
    Ramp,
    SparsityConfig,
    Uniform,
    sparsity_methods,
)
from prunelab.pruning.sparsity.methods import Magnitude, QKWanda, Rose, SparseGPT, Wanda
from prunelab.pruning.width.config import Width

for _name, _cls in (("depth", Depth), ("width", Width)):
    if _name not in METHODS:
        METHODS.register(_name)(_cls)


@register_pruner(Depth)
class _DepthPruner(Pruner):
    operation = "prune-depth"

    def run(self, lm, config, input_ids, *, batch_size):
        from prunelab.pruning.surgery import prune_depth

        rep = prune_depth(lm, config, input_ids, batch_size=batch_size)
        return DictReport(rep, history_keys=("removed_blocks", "recovery"))


@register_pruner(Width)
class _WidthPruner(Pruner):
    operation = "prune-width"

    def precheck(self, lm, config):
        from prunelab.pruning.width.execute import check_width

        check_width(lm, config)

    def run(self, lm, config, input_ids, *, batch_size):
        from prunelab.pruning.width.execute import prune_width

        rep = prune_width(lm, config, input_ids, batch_size=batch_size)
        return DictReport(rep, history_keys=("removed_params",))


__all__ = ["ALLOCATIONS", "METHODS", "Depth", "DictReport", "Magnitude", "MethodReport", "Owl",
           "Pals", "PruneReport", "Pruner", "QKWanda", "Ramp", "Rose", "SparseGPT",
           "SparsityConfig", "Uniform", "Wanda", "Width", "config_from_dict", "pruner_for",
           "register_pruner", "sparsity_methods"]
