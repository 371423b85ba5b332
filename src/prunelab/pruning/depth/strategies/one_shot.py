"""``one-shot``: the ``n`` blocks the probe scores most removable.

At ``granularity="sublayer"``: the attention / MLP sub-blocks the ``sublayer-ablation``
probe scores most removable, until the parameter budget is reached (BlockPruner's one-shot
baseline, Zhong et al. 2024)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.removal_plan import unit_name
from prunelab.pruning.depth.search_budget import (
    budget_for,
    sublayer_ranking,
    sublayer_result,
    take_until,
)
from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy


@STRATEGIES.register("one-shot")
@dataclass(frozen=True)
class OneShot(ScoredStrategy):
    """the n lowest removability values of the probe"""

    def choose(self, job):
        if job.cfg.granularity != "sublayer":
            return super().choose(job)

        result = sublayer_result(job)
        budget = budget_for(job.lm, job.cfg, job.n)
        chosen = sorted(take_until(sublayer_ranking(result), budget))
        how = {"strategy": "one-shot", "probe": result.probe, "from_probe": job.cfg.from_probe,
               "granularity": "sublayer", **budget.describe()}
        return [list(unit_name(u)) for u in chosen], how

    def pick(self, job, result, values, how):
        return sel.one_shot(values, job.n)
