"""Width allocations, one module each, registered in :data:`WIDTH_ALLOCATIONS`."""

from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS, WidthAllocation

# registration order = the order of CLI lists and error messages
# isort: off
from prunelab.pruning.width.allocation.uniform import Uniform
from prunelab.pruning.width.allocation.global_ import Global
from prunelab.pruning.width.allocation.taper import Taper
# isort: on

__all__ = ["WIDTH_ALLOCATIONS", "Global", "Taper", "Uniform", "WidthAllocation"]
