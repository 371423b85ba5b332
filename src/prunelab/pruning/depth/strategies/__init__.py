"""Depth selection strategies, one module each, registered in :data:`STRATEGIES`.

Adding one: a new module with a frozen dataclass registered with
``@STRATEGIES.register("name")`` that derives from :class:`Strategy` (implement
``choose``) or :class:`ScoredStrategy` (implement ``pick`` over the probe's per-block
values); the package imports it (or import it from anywhere before use).
"""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=(
    "one_shot", "no_adjacent", "span", "iterative", "beam", "sleb", "blend", "last_n",
    "random_blocks", "validation",
))

from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy, SelectJob, Strategy
from prunelab.pruning.depth.strategies.beam import Beam
from prunelab.pruning.depth.strategies.blend import Blend
from prunelab.pruning.depth.strategies.iterative import Iterative
from prunelab.pruning.depth.strategies.last_n import LastN
from prunelab.pruning.depth.strategies.no_adjacent import NoAdjacent
from prunelab.pruning.depth.strategies.one_shot import OneShot
from prunelab.pruning.depth.strategies.random_blocks import Random
from prunelab.pruning.depth.strategies.sleb import Sleb
from prunelab.pruning.depth.strategies.span import Span
from prunelab.pruning.depth.strategies.validation import Validation

__all__ = ["STRATEGIES", "Beam", "Blend", "Iterative", "LastN", "NoAdjacent", "OneShot",
           "Random", "ScoredStrategy", "SelectJob", "Sleb", "Span", "Strategy", "Validation"]
