"""``beam``: beam search over removal sets, seeded with the ``seeds`` most removable blocks
of the probe; each candidate set is scored by the calibration KL (or perplexity) of the
dense model without it. Chen et al., "No Free Swap", use width 3 and 12 seeds.

At ``granularity="sublayer"`` the pool is the most removable attention / MLP sub-blocks
of the ``sublayer-ablation`` probe (as many as the parameter budget needs, at least
``seeds``) and a set is complete when it reaches the budget (BlockPruner, Zhong et al.
2024); with ``recovery_in_loop`` every candidate is scored after its closed-form recovery
(see :mod:`prunelab.pruning.depth.removal_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.log import progress
from prunelab.pruning.depth.removal_plan import Plan, block_units
from prunelab.pruning.depth.search_budget import (
    search_result,
    search_setup,
    sublayer_pool,
    sublayer_result,
)
from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy, SelectJob
from prunelab.registry import check_range

BEAM_SCORES = ("kl", "perplexity")


@STRATEGIES.register("beam")
@dataclass(frozen=True)
class Beam(ScoredStrategy):
    """beam search over removal sets scored by calibration KL or perplexity"""

    width: int = field(default=3, metadata={"cli": "beam_width", "help": "beam: width"})
    seeds: int = field(default=12, metadata={"cli": "beam_seeds",
                                             "help": "beam: candidate blocks"})
    score: str = field(default="kl", metadata={"cli": "beam_score",
                                               "help": "beam: kl or perplexity"})

    def __post_init__(self):
        check_range("beam width", self.width, 1, None, integer=True)
        check_range("beam seeds", self.seeds, 1, None, integer=True)
        if self.score not in BEAM_SCORES:
            raise ConfigError(f"beam score must be kl or perplexity, got {self.score!r}")

    def choose(self, job: SelectJob) -> tuple[list, dict]:
        if job.cfg.granularity != "sublayer":
            return super().choose(job)

        result = sublayer_result(job)
        how = {"strategy": "beam", "probe": result.probe, "from_probe": job.cfg.from_probe}
        return beam_search(job, sublayer_pool(job, result, self.seeds), self, how)

    def pick(self, job, result, values, how):
        ranked = [i for i in sorted(range(len(values)),
                                    key=lambda i: (values[i] is None, values[i]))
                  if values[i] is not None][: max(self.seeds, job.n)]
        chosen, _ = beam_search(job, [block_units(b) for b in ranked], self, how)
        return chosen


def beam_search(job: SelectJob, pool: list, beam: Beam, how: dict) -> tuple[list, dict]:
    """Keep the ``beam.width`` cheapest sets of each size, each grown by one unit set of
    ``pool`` (whole blocks or single sub-blocks), until the budget is reached; the best
    complete set. ``how["beam"]`` gets the search statistics."""
    scorer, budget, evals0 = search_setup(job, "nll" if beam.score == "perplexity" else "kl")
    frontier, done, n_scored = [None], [], 0
    for _ in progress(range(budget.blocks or len(pool)), desc="beam search"):
        cands = {}
        for parent in frontier:
            plan = parent.plan if parent is not None else None
            for units in pool:
                if plan is not None and units & plan.removed:
                    continue
                key = units if plan is None else plan.removed | units
                if key not in cands:
                    cands[key] = scorer.candidate(plan or _empty(), units)
        n_scored += len(cands)
        ranked = sorted(cands.values(), key=lambda s: (s.value, sorted(s.plan.removed)))
        done = sorted(done + [s for s in ranked if budget.done(s.plan.removed)],
                      key=lambda s: (s.value, sorted(s.plan.removed)))[: beam.width]
        frontier = [s for s in ranked if not budget.done(s.plan.removed)][: beam.width]
        if not frontier:
            break
    if not done:
        raise ConfigError("beam: the candidate pool cannot reach the budget")
    best = done[0]
    how["beam"] = {"width": beam.width, "seeds": len(pool), "score": beam.score,
                   "best_cost": best.value, "sets_scored": n_scored}
    return search_result(job, best.plan, how, evals0)


def _empty():
    return Plan()
