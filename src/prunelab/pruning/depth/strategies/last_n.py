"""``last-n``: the deepest ``n`` blocks before the final one (a baseline; no probe)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.strategies.base import STRATEGIES, Strategy


@STRATEGIES.register("last-n")
@dataclass(frozen=True)
class LastN(Strategy):
    """the deepest n blocks before the final one (baseline, no probe)"""

    uses_probe = False

    def choose(self, job):
        return sel.last_n(job.lm.adapter.num_blocks, job.n), {"strategy": "last-n"}
