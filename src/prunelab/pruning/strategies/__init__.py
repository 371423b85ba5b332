"""Depth selection strategies, one module each, registered in :data:`STRATEGIES`.

Adding one: a new module with a frozen dataclass registered with
``@STRATEGIES.register("name")`` that derives from :class:`Strategy` (implement
``choose``) or :class:`ScoredStrategy` (implement ``pick`` over the probe's per-block
values), imported below (or from anywhere before use).
"""

from prunelab.pruning.strategies.base import STRATEGIES, ScoredStrategy, SelectJob, Strategy

# registration order = the order of CLI lists and error messages
# isort: off
from prunelab.pruning.strategies.one_shot import OneShot
from prunelab.pruning.strategies.no_adjacent import NoAdjacent
from prunelab.pruning.strategies.span import Span
from prunelab.pruning.strategies.iterative import Iterative
from prunelab.pruning.strategies.beam import Beam
from prunelab.pruning.strategies.sleb import Sleb
from prunelab.pruning.strategies.blend import Blend
from prunelab.pruning.strategies.last_n import LastN
from prunelab.pruning.strategies.random_blocks import Random
from prunelab.pruning.strategies.validation import Validation
# isort: on

__all__ = ["STRATEGIES", "Beam", "Blend", "Iterative", "LastN", "NoAdjacent", "OneShot",
           "Random", "ScoredStrategy", "SelectJob", "Sleb", "Span", "Strategy", "Validation"]
