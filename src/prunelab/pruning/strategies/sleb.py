"""``sleb`` (SLEB, Song et al. 2024, "SLEB: Streamlining LLMs through Redundancy
Verification and Elimination of Transformer Blocks"): remove one block at a time, each step
the block whose removal from the current model gives the lowest calibration NLL (SLEB's
metric; or the all-positions KL to dense with ``score="kl"``).

Each candidate starts from the current model's cached stream entering it and recomputes
only the blocks after it; after a removal is accepted the streams of the current model are
refreshed from the changed block on. At ``granularity="sublayer"`` the same greedy runs
over attention and MLP sub-blocks until the parameter budget is reached (BlockPruner,
Zhong et al. 2024); with ``recovery_in_loop`` each candidate is scored after its
closed-form recovery (see :mod:`prunelab.pruning.removal_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.log import progress
from prunelab.pruning.strategies.base import STRATEGIES, SelectJob, Strategy

SLEB_SCORES = ("nll", "kl")


@STRATEGIES.register("sleb")
@dataclass(frozen=True)
class Sleb(Strategy):
    """SLEB: greedy removal, each candidate scored by the calibration NLL (or KL)"""

    score: str = field(default="nll", metadata={"cli": "sleb_score",
                                                "help": "sleb: nll or kl"})
    protect_ends: bool = field(default=False, metadata={
        "help": "sleb: never remove the first or the last block"})

    uses_probe = False

    def __post_init__(self):
        if self.score not in SLEB_SCORES:
            raise ConfigError(f"sleb score must be nll or kl, got {self.score!r}")

    def choose(self, job: SelectJob) -> tuple[list, dict]:
        return greedy_search(job, self.score, self.protect_ends)


def search_setup(job: SelectJob, score: str):
    """``(scorer, budget, evals0)`` of a search on ``job`` (the context cached first, so
    the count excludes the dense pass)."""
    from prunelab.pruning.removal_plan import PlanScorer
    from prunelab.pruning.search_budget import budget_for

    cfg = job.cfg
    job.ctx.ensure_cached()
    scorer = PlanScorer(job.ctx, score, cfg.recovery if cfg.recovery_in_loop else None)
    return scorer, budget_for(job.lm, cfg, job.n), job.ctx.block_evaluations


def search_result(job: SelectJob, plan, how: dict, evals0: float) -> tuple[list, dict]:
    """The chosen blocks (block granularity) or ``[block, part]`` pairs, and ``how`` with
    the costs and, with recovery in the loop, the cuts whose repair helped."""
    from prunelab.pruning.removal_plan import block_spans

    how["granularity"] = job.cfg.granularity
    how["block_evaluations"] = job.ctx.block_evaluations - evals0
    how["cache_block_evaluations"] = job.ctx.cache_block_evaluations
    if job.cfg.recovery_in_loop:
        how["recovery_in_loop"] = True
        how["repaired_cuts"] = [list(c) for c in plan.repaired()]
        if job.cfg.granularity == "block":
            how["repair_spans"] = [list(s) for s in block_spans(plan.repaired())]
    if job.cfg.granularity == "sublayer":
        return [list(p) for p in plan.parts()], how
    return sorted({u // 2 for u in plan.removed}), how


def greedy_search(job: SelectJob, score: str, protect_ends: bool) -> tuple[list, dict]:
    """SLEB's loop over blocks or sub-blocks (see module docstring); ``how`` records each
    step's choice, its score and its score without its own cut repaired."""
    from prunelab.pruning.removal_plan import Plan, PlanStates, cut_block, cuts_of, unit_name
    from prunelab.pruning.search_budget import candidates

    if score == "nll" and job.ctx.encoder:
        raise ConfigError("sleb score nll needs a causal LM; use --sleb-score kl "
                          "(1 - cos for encoders)")
    scorer, budget, evals0 = search_setup(job, score)
    states, plan, steps = PlanStates(scorer), Plan(), []
    in_loop = scorer.recovery is not None
    while not budget.done(plan.removed):
        cands = candidates(job.ctx.num_blocks, plan.removed, job.cfg.granularity,
                           protect_ends)
        if not cands:
            raise ConfigError("sleb: no block left to remove within the budget")
        best = None
        for units in progress(cands, desc=f"sleb step {len(steps) + 1}"):
            s = scorer.candidate(plan, units, states)
            if best is None or s.value < best[0].value:
                best = (s, units)
        s, units = best
        plan = s.plan
        if in_loop:
            cut = next(c for c in cuts_of(plan.removed) if c[0] <= min(units) <= c[1])
            states.refresh(plan, cut_block(cut[0]))
        else:
            states.refresh(plan, min(units) // 2)
        what = [list(unit_name(u)) for u in sorted(units)] \
            if job.cfg.granularity == "sublayer" else min(units) // 2
        steps.append({"removed": what, "score": s.value, "score_without_recovery": s.raw})
    how = {"strategy": "sleb", "score": score, "protect_ends": protect_ends,
           **budget.describe(), "steps": steps}
    return search_result(job, plan, how, evals0)
