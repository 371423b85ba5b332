"""Planning width pruning: which heads / channels each block keeps.

A block's units are scored by the configured score (:mod:`prunelab.pruning.width.scoring`,
maths in :mod:`prunelab.pruning.width.scores`), turned into an ordered list of removal
*steps* (one KV group / head, one query head in every group, or one FFN channel) with a
score and a parameter cost, and the steps are taken by the configured allocation
(:mod:`prunelab.pruning.width.allocation`: the same count in every block, or cheapest
score first across blocks until the parameter budget is met). Scores that choose units
themselves (Putri heads, CoCurve) fill the plans directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram, MeanVar, SumSquares
from prunelab.errors import ConfigError
from prunelab.models.linear import in_out_features
from prunelab.pruning.width import scores as S

if TYPE_CHECKING:
    from prunelab.pruning.width.config import Width


@dataclass
class BlockPlan:
    """What block ``index`` keeps: KV groups (or heads) ``groups``; query heads per group
    ``query``; FFN channels ``ffn`` (``None``: unchanged)."""

    index: int
    groups: list[int] | None = None
    query: list[list[int]] | None = None
    ffn: list[int] | None = None
    scores: dict = field(default_factory=dict)


@dataclass
class Step:
    score: float
    cost: int
    block: int
    payload: object  # unit index, or (kind, unit) for joint


@dataclass
class WidthJob:
    """What a width score or allocation may use: the model, the config, the calibration
    windows, the block runner, the dense consumer statistics (or ``None``), the budget in
    parameters and the per-block plans to fill."""

    lm: Any
    cfg: Width
    input_ids: torch.Tensor
    batch_size: int
    runner: BlockRunner
    stats: dict | None
    budget: int
    plans: list[BlockPlan]

    @property
    def adapter(self):
        return self.lm.adapter


# ---------------------------------------------------------------- parameter costs
def _numel(m) -> int:
    b = getattr(m, "bias", None)
    return m.weight.numel() + (b.numel() if b is not None else 0)


def attn_params(ad, i: int) -> int:
    """Parameters of block ``i``'s attention projections that head pruning can remove
    (the consumer's bias stays)."""
    proj = ad.attn_projections(i)
    o = proj["o"]
    return sum(_numel(m) for m in proj.values()) - (o.bias.numel() if getattr(
        o, "bias", None) is not None else 0)


def mlp_params(ad, i: int) -> int:
    proj = ad.mlp_projections(i)
    d = proj["down"]
    return sum(_numel(m) for m in proj.values()) - (d.bias.numel() if getattr(
        d, "bias", None) is not None else 0)


def group_cost(ad, i: int) -> int:
    return attn_params(ad, i) // ad.head_geometry(i).num_kv_heads


def query_head_cost(ad, i: int) -> int:
    """Parameters one query head owns: its ``q_proj`` rows (and bias) and ``o_proj``
    columns."""
    proj, hd = ad.attn_projections(i), ad.head_geometry(i).head_dim
    q, o = proj["q"], proj["o"]
    bias = hd if getattr(q, "bias", None) is not None else 0
    return in_out_features(q)[0] * hd + bias + in_out_features(o)[1] * hd


def channel_cost(ad, i: int) -> int:
    return mlp_params(ad, i) // ad.ffn_width(i)


def unit_params(ad, unit: str, heads: str = "groups") -> int:
    """Parameters of the pruned unit kind over all blocks (query heads: their ``q_proj``
    rows and ``o_proj`` columns only, as ``k``/``v`` stay)."""
    n = ad.num_blocks
    total = 0
    if unit == "heads" and heads == "query":
        return sum(query_head_cost(ad, i) * ad.head_geometry(i).num_heads for i in range(n))
    if unit in ("heads", "joint"):
        total += sum(attn_params(ad, i) for i in range(n))
    if unit in ("ffn", "joint"):
        total += sum(mlp_params(ad, i) for i in range(n))
    return total


def removal_budget(lm, cfg: Width, total_params: int) -> int:
    """Parameters to remove: ``ratio`` of the unit's parameters, or down to
    ``target_params`` (a count, or a fraction <= 1 of ``total_params``)."""
    pool = unit_params(lm.adapter, cfg.unit, cfg.heads)
    if cfg.ratio is not None:
        budget = int(round(cfg.ratio * pool))
    else:
        target = cfg.target_params * total_params if cfg.target_params <= 1 \
            else cfg.target_params
        budget = int(round(total_params - target))
        if budget <= 0:
            raise ConfigError(f"--budget keep-params:{cfg.target_params:g}: the model already "
                              f"has {total_params:,} parameters")
    if budget > 0.95 * pool:
        raise ConfigError(f"the budget removes {budget:,} of the {pool:,} {cfg.unit} "
                          "parameters (more than 95%); ask for less")
    return budget


# ---------------------------------------------------------------- statistics
def needs_stats(cfg: Width, has_bias: bool) -> bool:
    """Whether the dense statistics pass is needed (by the score, or for FLAP's bias
    compensation of a biased consumer without a refit)."""
    if cfg.score.needs_stats(cfg.unit):
        return True
    return cfg.bias_compensation and has_bias and not cfg.compensate


def collect_stats(lm, cfg: Width, runner: BlockRunner) -> dict[int, dict]:
    """Dense statistics of the consumers' inputs, per block: ``{"o": [SumSquares,
    MeanVar], "down": [...(, Gram)]}`` (one dense pass that stops inside each block once
    the consumers have fired)."""
    ad = lm.adapter
    stats: dict[int, dict] = {}
    gram = cfg.score.needs_gram(cfg.unit)

    def make(name):
        accs = [SumSquares(), MeanVar()]
        return accs + [Gram()] if gram and name == "down" else accs

    def on_block(i, inputs):
        targets = {}
        if cfg.unit in ("heads", "joint") or ad.attn_projections(i)["o"].bias is not None:
            targets["o"] = ad.attn_projections(i)["o"]
        if cfg.unit in ("ffn", "joint") or ad.mlp_projections(i)["down"].bias is not None:
            targets["down"] = ad.mlp_projections(i)["down"]
        stats[i] = runner.collect(i, inputs, targets, make)

    runner.run(on_block=on_block, propagate="dense", desc="width statistics")
    return stats


# ---------------------------------------------------------------- steps
def kv_group_units(ad, blocks) -> Iterator[tuple[int, int, Any, torch.Tensor]]:
    """``(block, group, o_proj, o's input columns of the group)`` for every KV group of the
    given blocks: the units Putri and CoCurve ablate."""
    for i in blocks:
        geo = ad.head_geometry(i)
        o = ad.attn_projections(i)["o"]
        for g, cols in enumerate(S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim)):
            yield i, g, o, cols


def block_steps(lm, cfg: Width, i: int, s: torch.Tensor, protect, kind: str) -> list[Step]:
    """Removal steps of block ``i`` in order, each with its score and parameter cost."""
    ad = lm.adapter
    if kind == "ffn":
        order = S.removal_order(s, protect)
        cost = channel_cost(ad, i)
        return [Step(_rank_score(s, protect, u), cost, i, u) for u in order]
    if cfg.heads == "groups":
        order = S.removal_order(s, protect)
        cost = group_cost(ad, i)
        return [Step(_rank_score(s, protect, u), cost, i, u) for u in order]
    geo = ad.head_geometry(i)
    gs = geo.group_size
    per_group = [S.removal_order(s[g * gs:(g + 1) * gs],
                                 protect[g * gs:(g + 1) * gs] if protect is not None else None)
                 for g in range(geo.num_kv_heads)]
    cost = query_head_cost(ad, i) * geo.num_kv_heads
    steps = []
    for r in range(gs):
        heads = [g * gs + per_group[g][r] for g in range(geo.num_kv_heads)]
        score = sum(_rank_score(s, protect, h) for h in heads)
        steps.append(Step(score, cost, i, r))
    return steps


def _rank_score(s, protect, u) -> float:
    return float("inf") if protect is not None and bool(protect[u]) else float(s[u])


def plan_scored(job: WidthJob, score) -> dict:
    """The common plan: ``score.block_scores`` per block -> removal steps -> counts from
    the configured allocation -> what every block keeps (fills ``job.plans``)."""
    cfg, kind = job.cfg, job.cfg.unit
    steps = []
    for i, (s, protect) in enumerate(score.block_scores(job, kind)):
        job.plans[i].scores[kind] = s
        if not cfg.allocation.uniform and score.standardise_global:
            s = S.standardise(s)
        steps.append(block_steps(job.lm, cfg, i, s, protect, kind))
    counts = cfg.allocation.counts(job, steps, kind)
    plan_from_counts(job.lm, cfg, steps, counts, kind, job.plans)
    return {}


# ---------------------------------------------------------------- allocation
def min_steps_left(ad, cfg: Width, i: int, kind: str) -> int:
    """Steps that must stay in block ``i`` (at least one group / query head per group /
    ``round_to`` channels)."""
    if kind == "ffn":
        return min(cfg.round_to, ad.ffn_width(i))
    return 1


def plan_from_counts(lm, cfg: Width, steps: list[list[Step]], counts: list[int], kind: str,
                     plans: list[BlockPlan]) -> None:
    """Fill ``plans`` with what each block keeps after removing its first ``counts``
    steps."""
    ad = lm.adapter
    for i, (blk, k) in enumerate(zip(steps, counts, strict=True)):
        removed = {st.payload for st in blk[:k]}
        if kind == "ffn":
            plans[i].ffn = [c for c in range(ad.ffn_width(i)) if c not in removed]
        elif cfg.heads == "groups":
            plans[i].groups = [g for g in range(ad.head_geometry(i).num_kv_heads)
                               if g not in removed]
        else:
            plans[i].query = _query_keep(lm, cfg, i, plans[i].scores["heads"], k)


def _query_keep(lm, cfg, i, s, k) -> list[list[int]]:
    geo = lm.adapter.head_geometry(i)
    gs = geo.group_size
    protect = cfg.score.protect(s)
    keep = []
    for g in range(geo.num_kv_heads):
        order = S.removal_order(s[g * gs:(g + 1) * gs],
                                protect[g * gs:(g + 1) * gs] if protect is not None else None)
        keep.append(sorted(order[k:]))
    return keep
