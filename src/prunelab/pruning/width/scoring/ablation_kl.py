"""``ablation-kl`` (head ablation after Michel et al. 2019, measured as the KL of the
next-token distribution): each unit is masked alone on ``samples`` calibration windows.
FFN channels (derived) are ordered by wanda-sp and cut into chunks of ``channel_group``;
each chunk is masked once and its KL scores its channels (plus a tie-break by wanda-sp
rank inside the chunk)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.calib.ablation import Unit, ablation_kl
from prunelab.models.linear import weight_out_in
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.scoring.base import (
    WIDTH_SCORES,
    WidthScore,
    channel_group_field,
    check_ablation,
    samples_field,
)


@WIDTH_SCORES.register("ablation-kl")
@dataclass(frozen=True)
class AblationKL(WidthScore):
    """KL to the dense model with each unit masked alone (one pass per unit)"""

    samples: int = samples_field()
    channel_group: int = channel_group_field()

    def __post_init__(self):
        check_ablation(self.samples, self.channel_group)

    def needs_lm_head(self, unit):
        return True

    def needs_stats(self, unit):
        return unit == "ffn"  # wanda-sp order of the channels

    def block_scores(self, job, kind):
        per_block = head_scores(job, self) if kind == "heads" else ffn_scores(job, self)
        return [(s, None) for s in per_block]


def head_scores(job, score: AblationKL) -> list[torch.Tensor]:
    """ablation-kl of every head unit (KV groups or query heads) of every block."""
    ad, mode = job.adapter, job.cfg.heads
    units, where = [], []
    for i in range(ad.num_blocks):
        geo = ad.head_geometry(i)
        o = ad.attn_projections(i)["o"]
        for u, cols in enumerate(S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim,
                                              mode)):
            units.append(Unit(i, o, cols))
            where.append((i, u))
    kl = ablation_kl(job.lm, job.input_ids[:score.samples], units, job.batch_size)
    out = [torch.zeros(ad.head_geometry(i).num_heads if mode == "query"
                       else ad.head_geometry(i).num_kv_heads, dtype=torch.float64)
           for i in range(ad.num_blocks)]
    for (i, u), v in zip(where, kl, strict=True):
        out[i][u] = v
    return out


def ffn_scores(job, score: AblationKL) -> list[torch.Tensor]:
    """ablation-kl of FFN channel chunks (see module)."""
    ad = job.adapter
    units, where, out = [], [], []
    for i in range(ad.num_blocks):
        down = ad.mlp_projections(i)["down"]
        ws = S.wanda_sp_columns(weight_out_in(down).detach(), job.stats[i]["down"][0].sum_sq)
        order = torch.argsort(ws, stable=True)
        for chunk in order.split(score.channel_group):
            units.append(Unit(i, down, chunk))
            where.append((i, chunk))
        out.append(torch.zeros_like(ws))
        rank = torch.empty_like(ws)
        rank[order] = torch.arange(len(order), dtype=ws.dtype)
        out[i] += rank / (len(order) * 1e6)
    kl = ablation_kl(job.lm, job.input_ids[:score.samples], units, job.batch_size)
    for (i, chunk), v in zip(where, kl, strict=True):
        out[i][chunk] += v
    return out
