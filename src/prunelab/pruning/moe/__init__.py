"""PrunePath: gated FFNs as mixtures of experts with a cumulative-mass router (MoEfication,
Zhang et al. 2022, arXiv:2110.01786; the routing mass ``p`` is a runtime knob)."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__)

from prunelab.pruning.moe.config import PrunePath, PrunePathPruner
from prunelab.pruning.moe.module import (
    MASS_ATTR,
    PrunePathMLP,
    prunepath_modules,
    reset_stats,
    routing_stats,
    set_mass,
)

__all__ = ["MASS_ATTR", "PrunePath", "PrunePathMLP", "PrunePathPruner", "prunepath_modules",
           "reset_stats", "routing_stats", "set_mass"]
