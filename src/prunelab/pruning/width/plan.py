"""Scoring and allocation of width units: which heads / channels each block keeps.

A block's units are scored (see :mod:`prunelab.pruning.width.scores`), turned into an
ordered list of removal *steps* (one KV group / head, one query head in every group, or
one FFN channel) with a score and a parameter cost, and the steps are taken either
uniformly (the same count in every block) or globally (cheapest score first across blocks
until the parameter budget is met).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram, MeanVar, SumSquares
from prunelab.errors import ConfigError
from prunelab.models.linear import in_out_features, weight_out_in
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.ablation import ablation_kl
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
            raise ConfigError(f"--target-params {cfg.target_params:g}: the model already "
                              f"has {total_params:,} parameters")
    if budget > 0.95 * pool:
        raise ConfigError(f"the budget removes {budget:,} of the {pool:,} {cfg.unit} "
                          "parameters (more than 95%); ask for less")
    return budget


# ---------------------------------------------------------------- statistics
def needs_stats(cfg: Width, has_bias: bool) -> bool:
    if cfg.unit == "joint" or cfg.score in ("wanda-sp", "flap"):
        return True
    if cfg.score in ("putri", "ablation-kl") and cfg.unit == "ffn":
        return True
    return cfg.bias_compensation and has_bias and not cfg.compensate


def collect_stats(lm, cfg: Width, runner: BlockRunner) -> dict[int, dict]:
    """Dense statistics of the consumers' inputs, per block: ``{"o": [SumSquares,
    MeanVar], "down": [...(, Gram)]}`` (one dense pass that stops inside each block once
    the consumers have fired)."""
    ad = lm.adapter
    stats: dict[int, dict] = {}
    gram = cfg.score == "putri" and cfg.unit == "ffn"

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


# ---------------------------------------------------------------- scores
def column_scores(cfg: Width, w: torch.Tensor, accs: list | None) -> torch.Tensor:
    """Per input column of a consumer, by the configured score."""
    if cfg.score == "magnitude-profile":
        return S.magnitude_columns(w)
    if cfg.score == "flap":
        return S.flap_columns(w, accs[1].var())
    if cfg.score == "putri":
        return S.putri_columns(w, accs[2].xtx, damp=max(cfg.damp, 1e-2))
    return S.wanda_sp_columns(w, accs[0].sum_sq)


def head_scores(lm, cfg: Width, i: int, stats) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of block ``i``'s head units (groups or query heads) and the outlier mask
    (magnitude profile keeps outliers)."""
    ad = lm.adapter
    geo = ad.head_geometry(i)
    o = ad.attn_projections(i)["o"]
    units = S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim, cfg.heads)
    col = column_scores(cfg, weight_out_in(o).detach(), stats[i]["o"] if stats else None)
    reduce = "norm" if cfg.score == "magnitude-profile" else "sum"
    s = S.unit_scores(col, units, reduce)
    protect = S.outliers(s, cfg.outlier_z) if cfg.score == "magnitude-profile" else None
    return s, protect


def ffn_scores(lm, cfg: Width, i: int, stats) -> tuple[torch.Tensor, torch.Tensor | None]:
    ad = lm.adapter
    down = ad.mlp_projections(i)["down"]
    s = column_scores(cfg, weight_out_in(down).detach(), stats[i]["down"] if stats else None)
    if cfg.score == "magnitude-profile":
        s = s.sqrt()
        return s, S.outliers(s, cfg.outlier_z)
    return s, None


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


def ablation_head_scores(lm, cfg: Width, ids: torch.Tensor, batch_size: int
                         ) -> list[torch.Tensor]:
    """ablation-kl for every head unit of every block (one forward pass per unit)."""
    ad = lm.adapter
    units, where = [], []
    for i in range(ad.num_blocks):
        geo = ad.head_geometry(i)
        o = ad.attn_projections(i)["o"]
        for u, cols in enumerate(S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim,
                                              cfg.heads)):
            units.append((o, cols))
            where.append((i, u))
    kl = ablation_kl(lm.model, ids[:cfg.ablation_samples], units, batch_size)
    out = [torch.zeros(ad.head_geometry(i).num_heads if cfg.heads == "query"
                       else ad.head_geometry(i).num_kv_heads, dtype=torch.float64)
           for i in range(ad.num_blocks)]
    for (i, u), v in zip(where, kl, strict=True):
        out[i][u] = v
    return out


def ablation_ffn_scores(lm, cfg: Width, ids, batch_size: int, stats) -> list[torch.Tensor]:
    """ablation-kl for FFN channels (derived): channels are ordered by wanda-sp and cut into
    chunks of ``channel_group``; each chunk is masked once and its KL is the score of its
    channels (plus a tie-break by wanda-sp rank inside the chunk)."""
    ad = lm.adapter
    units, where, out = [], [], []
    for i in range(ad.num_blocks):
        down = ad.mlp_projections(i)["down"]
        ws = S.wanda_sp_columns(weight_out_in(down).detach(), stats[i]["down"][0].sum_sq)
        order = torch.argsort(ws, stable=True)
        for chunk in order.split(cfg.channel_group):
            units.append((down, chunk))
            where.append((i, chunk))
        out.append(torch.zeros_like(ws))
        rank = torch.empty_like(ws)
        rank[order] = torch.arange(len(order), dtype=ws.dtype)
        out[i] += rank / (len(order) * 1e6)
    kl = ablation_kl(lm.model, ids[:cfg.ablation_samples], units, batch_size)
    for (i, chunk), v in zip(where, kl, strict=True):
        out[i][chunk] += v
    return out


# ---------------------------------------------------------------- allocation
def min_steps_left(ad, cfg: Width, i: int, kind: str) -> int:
    """Steps that must stay in block ``i`` (at least one group / query head per group /
    ``round_to`` channels)."""
    if kind == "ffn":
        return min(cfg.round_to, ad.ffn_width(i))
    return 1


def uniform_counts(lm, cfg: Width, kind: str, budget: int) -> list[int]:
    """Steps removed in every block for a uniform allocation of ``budget`` parameters."""
    ad = lm.adapter
    pool = unit_params(ad, kind, cfg.heads)
    ratio = budget / pool
    counts = []
    for i in range(ad.num_blocks):
        if kind == "ffn":
            width = ad.ffn_width(i)
            keep = S.round_width(width, width * (1 - ratio), cfg.round_to)
            counts.append(width - keep)
        else:
            geo = ad.head_geometry(i)
            n = geo.num_kv_heads if cfg.heads == "groups" else geo.group_size
            counts.append(min(int(round(ratio * n)), n - 1))
    if not any(counts):
        what = "FFN channels" if kind == "ffn" else (
            "KV groups" if cfg.heads == "groups" else "query heads per group")
        raise ConfigError(f"ratio {ratio:.3f} removes no {what} in any block (steps are "
                          "whole units): ask for more")
    return counts


def global_counts(lm, cfg: Width, steps: list[list[Step]], kind: str, budget: int
                  ) -> list[int]:
    """Cheapest-score-first across blocks (each block's steps in order) until ``budget``
    parameters are removed; FFN counts are then rounded to keep multiples of
    ``round_to``."""
    ad = lm.adapter
    flat = sorted((st for blk in steps for st in blk), key=lambda st: (st.score, st.block))
    taken = [0] * ad.num_blocks
    limit = [len(blk) - min_steps_left(ad, cfg, i, kind) for i, blk in enumerate(steps)]
    removed = 0
    for st in flat:
        if removed >= budget:
            break
        i = st.block
        if taken[i] >= limit[i]:
            continue
        taken[i] += 1
        removed += st.cost
    if kind == "ffn":
        taken = [ad.ffn_width(i) - S.round_width(ad.ffn_width(i), ad.ffn_width(i) - t,
                                                  cfg.round_to) for i, t in enumerate(taken)]
    if not any(taken):
        raise ConfigError("the budget removes no unit: ask for more")
    return taken


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
    protect = S.outliers(s, cfg.outlier_z) if cfg.score == "magnitude-profile" else None
    keep = []
    for g in range(geo.num_kv_heads):
        order = S.removal_order(s[g * gs:(g + 1) * gs],
                                protect[g * gs:(g + 1) * gs] if protect is not None else None)
        keep.append(sorted(order[k:]))
    return keep
