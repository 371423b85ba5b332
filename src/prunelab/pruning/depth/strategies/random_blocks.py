"""``random``: ``n`` blocks drawn uniformly with the Depth config's ``seed`` (a baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.strategies.base import STRATEGIES, Strategy


@STRATEGIES.register("random")
@dataclass(frozen=True)
class Random(Strategy):
    """n blocks drawn uniformly with the config's seed (baseline, no probe)"""

    uses_probe = False

    def choose(self, job):
        seed = job.cfg.seed
        return (sel.random_blocks(job.lm.adapter.num_blocks, job.n, seed),
                {"strategy": "random", "seed": seed})
