"""Budgets and option checks of the depth searches (``granularity`` and
``recovery_in_loop`` of :class:`~prunelab.pruning.depth.config.Depth`), and the start and
end every search shares (:func:`search_setup`, :func:`search_result`).

At block granularity the budget is a number of blocks ``n`` (from ``remove``,
``target_params`` or ``blocks``, as before). At sub-block granularity (BlockPruner, Zhong
et al. 2024) the budget is **parameters removed**: ``remove = n`` means ``n`` blocks'
worth, ``n x`` the parameters of block 0's attention and MLP branches with their norms
(:func:`prunelab.models.sublayer.sublayer_params`); ``target_params`` (a fraction of the
parameters to keep when <= 1, else a count) means ``total - target``. A search removes
sub-blocks until the removed parameters reach the budget (the last one may pass it by
less than one sub-block), so a sub-block plan never removes fewer parameters than the
block plan it is compared with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prunelab.errors import ConfigError
from prunelab.models.size import model_size
from prunelab.models.sublayer import PARTS, sublayer_params
from prunelab.pruning.depth.fast_loop import FastScorer
from prunelab.pruning.depth.holdout import HoldoutScorer
from prunelab.pruning.depth.recoveries import RECOVERIES
from prunelab.pruning.depth.removal_plan import PlanScorer, block_spans, block_units, unit_of

if TYPE_CHECKING:
    from prunelab.pruning.depth.strategies.base import SelectJob

GRANULARITIES = ("block", "sublayer")
#: strategies that score candidates (recovery in the loop applies to them)
IN_LOOP_STRATEGIES = ("beam", "sleb", "iterative", "validation")
SUBLAYER_STRATEGIES = ("one-shot", "beam", "sleb")
SUBLAYER_RECOVERIES = ("none", "foldable", "ghost", "lra")


def check_search_options(cfg) -> None:
    """Refuse combinations of ``granularity`` / ``recovery_in_loop`` with the strategy and
    recovery that do not apply (one-line :class:`ConfigError`)."""
    if cfg.granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be block or sublayer, got {cfg.granularity!r}")
    name = None if cfg.select is None else type(cfg.select).registry_name
    rec = RECOVERIES.name_of(cfg.recovery)
    if cfg.recovery_in_loop:
        if name not in IN_LOOP_STRATEGIES:
            raise ConfigError("--recovery-in-loop applies to --strategy validation, beam, "
                              f"sleb or iterative, not {name or 'the default one-shot'}")
        if not cfg.recovery.fits:
            raise ConfigError("--recovery-in-loop needs a --recovery that fits (foldable, "
                              "boundary, ghost or lra)")
    if cfg.granularity == "sublayer":
        if cfg.blocks:
            raise ConfigError("--granularity sublayer chooses sub-blocks: --blocks does "
                              "not apply")
        if (name or "one-shot") not in SUBLAYER_STRATEGIES:
            raise ConfigError("--granularity sublayer supports --strategy one-shot, beam or "
                              f"sleb, not {name}")
        if rec not in SUBLAYER_RECOVERIES:
            raise ConfigError("--granularity sublayer supports --recovery none, foldable, "
                              f"ghost or lra, not {rec}")


@dataclass(frozen=True)
class Budget:
    """When a plan of removed units is complete: ``blocks`` whole blocks, or ``params``
    parameters removed (``unit_params``: parameters of each unit)."""

    blocks: int | None = None
    params: int | None = None
    unit_params: tuple = ()

    def removed_params(self, removed) -> int:
        return sum(self.unit_params[u] for u in removed)

    def done(self, removed) -> bool:
        if self.blocks is not None:
            return len(removed) // 2 >= self.blocks
        return self.removed_params(removed) >= self.params

    def describe(self) -> dict:
        if self.blocks is not None:
            return {"blocks": self.blocks}
        return {"params_to_remove": self.params}


def unit_params(adapter) -> tuple:
    """Parameters of every unit ``2 b + p`` (branch plus the norms only it uses)."""
    return tuple(sublayer_params(adapter, u // 2, PARTS[u % 2])
                 for u in range(2 * adapter.num_blocks))


def budget_for(lm, cfg, n: int) -> Budget:
    """The search budget of ``cfg`` (see module docstring); ``n``: blocks at block
    granularity."""
    if cfg.granularity != "sublayer":
        return Budget(blocks=n)
    params = unit_params(lm.adapter)
    per_block = params[0] + params[1]
    if cfg.remove is not None:
        want = cfg.remove * per_block
    else:
        total = model_size(lm.model)["params"]
        tp = cfg.target_params
        want = math.ceil(total - (tp * total if tp <= 1 else tp))
    if want <= 0 or want >= sum(params):
        raise ConfigError(f"cannot remove {want:,} parameters in sub-blocks "
                          f"(the blocks hold {sum(params):,})")
    return Budget(params=int(want), unit_params=params)


def candidates(num_blocks: int, removed, granularity: str, protect_ends: bool = False
               ) -> list[frozenset]:
    """The units a greedy step may remove next: whole blocks or single sub-blocks not
    yet removed (``protect_ends``: never from the first or last block)."""
    skip = {0, num_blocks - 1} if protect_ends else set()
    blocks = [b for b in range(num_blocks) if b not in skip]
    if granularity == "sublayer":
        return [frozenset((2 * b + p,)) for b in blocks for p in (0, 1)
                if 2 * b + p not in removed]
    return [block_units(b) for b in blocks if not block_units(b) & removed]


def sublayer_ranking(result) -> list[int]:
    """Units by a sub-block probe's value, most removable first (ties: stack order)."""
    if result.kind != "sublayer":
        raise ConfigError(f"--granularity sublayer ranks sub-blocks by a sub-block probe "
                          f"(sublayer-ablation), not {result.probe}")
    vals = {unit_of(s["layers"][0], s["sublayer"]): s["value"] for s in result.scores}
    sign = 1 if result.lower_is_removable else -1
    return sorted(vals, key=lambda u: (sign * vals[u], u))


def sublayer_result(job):
    """The sub-block probe result of a search job: the main probe's (or ``from_probe``)
    when it scores sub-blocks, else a ``sublayer-ablation`` run."""
    cfg = job.cfg
    if cfg.from_probe or cfg.probe == "sublayer-ablation":
        return job.result()
    return job.run_probe("sublayer-ablation", job.ctx, job.n)


def take_until(ranked: list[int], budget: Budget) -> list[int]:
    """The leading units of ``ranked`` until ``budget`` is reached."""
    chosen: list[int] = []
    for u in ranked:
        if budget.done(chosen):
            break
        chosen.append(u)
    if not budget.done(chosen):
        raise ConfigError("the ranked sub-blocks cannot reach the parameter budget")
    return chosen


def sublayer_pool(job, result, seeds: int) -> list[frozenset]:
    """The beam's sub-block pool: the most removable units of ``result``, at least
    ``seeds`` of them and enough to reach the budget."""
    budget = budget_for(job.lm, job.cfg, job.n)
    ranked = sublayer_ranking(result)
    need = len(take_until(ranked, budget))
    return [frozenset((u,)) for u in ranked[: max(seeds, need)]]


def search_setup(job: SelectJob, score: str, fast: bool = False):
    """``(scorer, budget, evals0)`` of a search on ``job`` (the context cached first, so
    the count excludes the dense pass). ``fast`` (greedy searches, default
    :data:`FAST_IN_LOOP`): a :class:`~prunelab.pruning.depth.fast_loop.FastScorer` for
    recovery in the loop at block granularity."""
    cfg = job.cfg
    job.ctx.ensure_cached()
    if fast and cfg.recovery_in_loop and cfg.granularity == "block":
        scorer = FastScorer(job.ctx, score, cfg.recovery, cfg.holdout)
    elif cfg.recovery_in_loop and cfg.holdout > 0:
        scorer = HoldoutScorer(job.ctx, score, cfg.recovery, cfg.holdout)
    else:
        scorer = PlanScorer(job.ctx, score, cfg.recovery if cfg.recovery_in_loop else None)
    return scorer, budget_for(job.lm, cfg, job.n), job.ctx.block_evaluations


def search_result(job: SelectJob, plan, how: dict, evals0: float) -> tuple[list, dict]:
    """The chosen blocks (block granularity) or ``[block, part]`` pairs, and ``how`` with
    the costs and, with recovery in the loop, the cuts whose repair helped."""
    how["granularity"] = job.cfg.granularity
    how["block_evaluations"] = job.ctx.block_evaluations - evals0
    how["cache_block_evaluations"] = job.ctx.cache_block_evaluations
    if job.cfg.recovery_in_loop:
        how["recovery_in_loop"] = True
        how["recovery_holdout"] = job.cfg.holdout
        how["repaired_cuts"] = [list(c) for c in plan.repaired()]
        if job.cfg.granularity == "block":
            how["repair_spans"] = [list(s) for s in block_spans(plan.repaired())]
    if job.cfg.granularity == "sublayer":
        return [list(p) for p in plan.parts()], how
    return sorted({u // 2 for u in plan.removed}), how
