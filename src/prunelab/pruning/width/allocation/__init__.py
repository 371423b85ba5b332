"""Width allocations, one module each, registered in :data:`WIDTH_ALLOCATIONS`."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("uniform", "global_", "taper"))

from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS, WidthAllocation
from prunelab.pruning.width.allocation.global_ import Global
from prunelab.pruning.width.allocation.taper import Taper
from prunelab.pruning.width.allocation.uniform import Uniform

__all__ = ["WIDTH_ALLOCATIONS", "Global", "Taper", "Uniform", "WidthAllocation"]
