"""``no-adjacent``: lowest removability first, never two adjacent blocks (for pair probes,
``r(l) = min(d(l, l-1), d(l, l+1))``; Chen et al., "No Free Swap")."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy


@STRATEGIES.register("no-adjacent")
@dataclass(frozen=True)
class NoAdjacent(ScoredStrategy):
    """greedy lowest first, never two adjacent blocks (default for pair probes)"""

    def pick(self, job, result, values, how):
        return sel.no_adjacent(values, job.n)
