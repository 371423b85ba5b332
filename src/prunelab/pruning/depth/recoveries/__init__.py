"""Depth recoveries, one module each, registered in :data:`RECOVERIES`.

Adding one: a new module with a frozen dataclass registered with
``@RECOVERIES.register("name")`` deriving from :class:`Recovery` (implement ``at_block``;
``check`` and ``at_embeddings`` where it applies); the package imports it (or import it
from anywhere before use).
"""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("none", "foldable", "boundary", "ghost", "lra"))

from prunelab.pruning.depth.recoveries.base import RECOVERIES, Recovery
from prunelab.pruning.depth.recoveries.boundary import Boundary
from prunelab.pruning.depth.recoveries.foldable import Foldable
from prunelab.pruning.depth.recoveries.ghost import Ghost
from prunelab.pruning.depth.recoveries.linear_bridge import BridgeRecovery
from prunelab.pruning.depth.recoveries.lra import Lra
from prunelab.pruning.depth.recoveries.none import NoRecovery

__all__ = ["RECOVERIES", "Boundary", "BridgeRecovery", "Foldable", "Ghost", "Lra",
           "NoRecovery", "Recovery"]
