"""Pruning methods: one verb, dispatched on a typed config.

``prunelab.prune(model, Depth(remove=6, probe="block-influence", recovery="foldable"),
data)``, ``prunelab.prune(model, Width(unit="ffn", score=WandaSP(), ratio=0.2), data)``.
Each method is a frozen dataclass config registered in :data:`METHODS` plus a
:class:`~prunelab.pruning.base.Pruner` registered for its type (see
:mod:`prunelab.pruning.base`). Depth's selection strategies and recoveries, and width's
scores and allocations, are registered configs too (:data:`STRATEGIES`,
:data:`RECOVERIES`, :data:`WIDTH_SCORES`, :data:`WIDTH_ALLOCATIONS`).
"""

from __future__ import annotations

from prunelab.pruning.base import (
    METHODS,
    PRUNERS,
    DictReport,
    MethodReport,
    Pruner,
    PruneReport,
    config_from_dict,
    pruner_for,
)
from prunelab.registry import import_submodules

# every piece registers (in the order the CLI and the docs list methods in: depth, width
# (then elastic), then the other packages by name; tokens sorts last)
import_submodules(__name__, first=("depth", "width"))

from prunelab.pruning.depth.config import Depth, depth_from_cli
from prunelab.pruning.depth.recoveries import (
    RECOVERIES,
    Boundary,
    Foldable,
    Ghost,
    Lra,
    NoRecovery,
    Recovery,
)
from prunelab.pruning.depth.report import DepthReport
from prunelab.pruning.depth.strategies import (
    STRATEGIES,
    Beam,
    Blend,
    Iterative,
    LastN,
    NoAdjacent,
    OneShot,
    Random,
    Sleb,
    Span,
    Strategy,
)
from prunelab.pruning.depth.surgery import DepthPruner
from prunelab.pruning.factor import FactorConfig, factor_methods
from prunelab.pruning.gates.config import Gates, GatesPruner
from prunelab.pruning.moe import PrunePath
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
from prunelab.pruning.tokens import TokenPruning
from prunelab.pruning.width import (
    WIDTH_ALLOCATIONS,
    WIDTH_SCORES,
    Width,
    WidthAllocation,
    WidthScore,
    width_from_cli,
)
from prunelab.pruning.width.elastic import ElasticRanking
from prunelab.pruning.width.execute import WidthPruner, WidthReport

__all__ = ["ALLOCATIONS", "METHODS", "PRUNERS", "RECOVERIES", "STRATEGIES", "WIDTH_ALLOCATIONS",
           "WIDTH_SCORES", "Beam", "Blend", "Boundary", "Depth", "DepthPruner", "DepthReport",
           "DictReport", "FactorConfig", "Foldable", "Ghost", "Iterative", "LastN", "Lra",
           "Gates", "GatesPruner", "Magnitude", "factor_methods",
           "MethodReport", "NoAdjacent", "NoRecovery", "OneShot", "Owl", "Pals", "PruneReport",
           "Pruner", "PrunePath", "QKWanda", "Ramp", "Random", "Recovery", "Rose", "SparseGPT",
           "Sleb", "SparsityConfig", "Span", "Strategy", "TokenPruning", "Uniform", "Wanda",
           "Width", "ElasticRanking",
           "WidthAllocation", "WidthPruner", "WidthReport", "WidthScore", "config_from_dict",
           "depth_from_cli", "pruner_for", "sparsity_methods",
           "width_from_cli"]
