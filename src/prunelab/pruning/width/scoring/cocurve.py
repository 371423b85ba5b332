"""``cocurve`` (derived), unit ``joint``: KV groups and FFN channel chunks (wanda-sp order,
``channel_group`` channels each) are each ablated once on ``samples`` windows; their
per-token loss changes give a linear term and a Fisher-style interaction matrix, and a box
QP under the parameter budget, rounded greedily, chooses what goes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.calib.ablation import Unit, loss_deltas
from prunelab.models.linear import weight_out_in
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.plan import channel_cost, group_cost, kv_group_units
from prunelab.pruning.width.scoring.base import (
    WIDTH_SCORES,
    WidthScore,
    channel_group_field,
    check_ablation,
    samples_field,
)


@WIDTH_SCORES.register("cocurve")
@dataclass(frozen=True)
class CoCurve(WidthScore):
    """heads and FFN chunks jointly: ablation loss changes and their interactions, QP"""

    samples: int = samples_field()
    channel_group: int = channel_group_field()

    units = ("joint",)

    def __post_init__(self):
        check_ablation(self.samples, self.channel_group)

    def needs_lm_head(self, unit):
        return True

    def needs_stats(self, unit):
        return True

    def plan(self, job):
        return plan_cocurve(job, self)


def _wanda_down(ad, stats, i) -> torch.Tensor:
    down = ad.mlp_projections(i)["down"]
    return S.wanda_sp_columns(weight_out_in(down).detach(), stats[i]["down"][0].sum_sq)


def _units(ad, stats, group: int) -> tuple[list[Unit], list[tuple]]:
    """The ablated units and ``(kind, block, group or channels, cost, width)`` of each."""
    units, meta = [], []
    for i in range(ad.num_blocks):
        for _, g, o, cols in kv_group_units(ad, (i,)):
            units.append(Unit(i, o, cols))
            meta.append(("heads", i, g, group_cost(ad, i), len(cols)))
        down = ad.mlp_projections(i)["down"]
        for chunk in torch.argsort(_wanda_down(ad, stats, i), stable=True).split(group):
            units.append(Unit(i, down, chunk))
            meta.append(("ffn", i, chunk.tolist(), channel_cost(ad, i) * len(chunk),
                         len(chunk)))
    return units, meta


def plan_cocurve(job, score: CoCurve) -> dict:
    """Ablate, solve the QP, round, and fill the plans (FFN widths rounded to
    ``round_to`` by giving back / taking the best-scored channels by wanda-sp)."""
    ad, cfg, budget = job.adapter, job.cfg, job.budget
    units, meta = _units(ad, job.stats, score.channel_group)
    deltas = loss_deltas(job.lm, job.input_ids[:score.samples], units, job.batch_size)
    a, f = S.cocurve_features(deltas)
    c = torch.tensor([m[3] for m in meta], dtype=torch.float64)
    z = S.solve_box_qp(a, f, c, float(budget))

    def allowed(chosen, u):
        kind, i = meta[u][0], meta[u][1]
        same = [v for v in chosen if meta[v][0] == kind and meta[v][1] == i]
        if kind == "heads":
            return len(same) + 1 < ad.head_geometry(i).num_kv_heads
        left = ad.ffn_width(i) - sum(meta[v][4] for v in same) - meta[u][4]
        return left >= min(cfg.round_to, ad.ffn_width(i))
    chosen = S.greedy_round(z, c, float(budget), allowed, a, f)
    for i in range(ad.num_blocks):
        gone_g = {meta[u][2] for u in chosen if meta[u][:2] == ("heads", i)}
        gone_c = {ch for u in chosen if meta[u][:2] == ("ffn", i) for ch in meta[u][2]}
        job.plans[i].groups = [g for g in range(ad.head_geometry(i).num_kv_heads)
                               if g not in gone_g]
        job.plans[i].ffn = _kept_channels(ad, job.stats, cfg, i, gone_c)
    return {"cocurve": {"units": len(units), "qp_objective": S.quadratic_cost(a, f, chosen),
                        "relaxed_removed_cost": float(c @ z)}}


def _kept_channels(ad, stats, cfg, i: int, gone: set) -> list[int]:
    """Block ``i``'s kept channels, rounded to a multiple of ``round_to``."""
    keep = [ch for ch in range(ad.ffn_width(i)) if ch not in gone]
    width = S.round_width(ad.ffn_width(i), len(keep), cfg.round_to)
    if width > len(keep):  # give back the best-scored removed channels
        ws = _wanda_down(ad, stats, i)
        back = sorted(gone, key=lambda ch: -float(ws[ch]))[:width - len(keep)]
        keep = sorted(keep + back)
    elif width < len(keep):
        ws = _wanda_down(ad, stats, i)
        keep = sorted(sorted(keep, key=lambda ch: -float(ws[ch]))[:width])
    return keep
