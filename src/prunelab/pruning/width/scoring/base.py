"""The contract of a width score: how heads / KV groups / FFN channels are ranked.

A score is a frozen dataclass registered in :data:`WIDTH_SCORES` under its CLI name; its
fields are its own parameters (``metadata={"help": ...}``, ``"cli"`` where the flat
option's name differs). It declares the units it scores (``units``), whether it needs the
LM head, the dense statistics pass (and a Gram matrix of the FFN consumer's input), and
either per-block unit scores (:meth:`WidthScore.block_scores`, then the configured
allocation decides) or a whole plan (:meth:`WidthScore.plan`, for scores that choose units
themselves). Scores that rank a consumer's input columns derive from :class:`ColumnScore`
and implement :meth:`ColumnScore.columns`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.models.linear import weight_out_in
from prunelab.models.streaming import holding
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.plan import WidthJob, plan_scored
from prunelab.registry import Registry, check_range

#: Width scores by name ("wanda-sp", "magnitude-profile", "flap", "ablation-kl", "putri",
#: "cocurve").
WIDTH_SCORES = Registry("width score")


@dataclass(frozen=True)
class WidthScore:
    """Base of the registered width scores."""

    #: the units (``Width.unit``) this score ranks
    units: ClassVar[tuple[str, ...]] = ("heads", "ffn")
    #: FLAP: scores are standardised per block before units compete across blocks
    standardise_global: ClassVar[bool] = False

    def validate(self, cfg) -> None:
        """Refuse a :class:`~prunelab.pruning.width.config.Width` this score cannot serve
        (called at the config's construction; ``unit`` is checked already)."""

    def needs_lm_head(self, unit: str) -> bool:
        """Whether the score measures the LM loss (refused on a bare encoder)."""
        return False

    def needs_stats(self, unit: str) -> bool:
        """Whether the dense statistics pass over the consumers' inputs is needed."""
        return False

    def needs_gram(self, unit: str) -> bool:
        """Whether the statistics include ``X^T X`` of the FFN consumer's input."""
        return False

    def protect(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Units kept whatever their score (bool mask), or ``None``."""
        return None

    def plan(self, job: WidthJob) -> dict:
        """Fill ``job.plans``; returns extra report entries (default: per-block scores,
        then the allocation)."""
        return plan_scored(job, self)

    def block_scores(self, job: WidthJob, kind: str) -> list[tuple[torch.Tensor, object]]:
        """``(scores of the block's units, protect mask or None)`` per block, low =
        removed first."""
        raise TypeError(f"{type(self).__name__} does not define block_scores()")


@dataclass(frozen=True)
class ColumnScore(WidthScore):
    """A score of the consumer's input columns, summed per head unit."""

    #: how a head unit's column scores combine: "sum" or "norm" (square root of the sum)
    head_reduce: ClassVar[str] = "sum"

    def columns(self, w: torch.Tensor, accs: list | None, job: WidthJob) -> torch.Tensor:
        """Per input column of a consumer weight ``w`` ``[d_out, d_in]`` given its input
        statistics ``accs`` (``[SumSquares, MeanVar(, Gram)]`` or ``None``)."""
        raise TypeError(f"{type(self).__name__} does not define columns()")

    def channel_values(self, columns: torch.Tensor) -> torch.Tensor:
        """FFN channel scores from the ``down`` projection's column scores."""
        return columns

    def block_scores(self, job, kind):
        out = []
        for i in range(job.adapter.num_blocks):
            with holding(job.runner, job.adapter.block(i)):  # streamed: read from disk
                out.append(self.unit_scores(job, i, kind))
        return out

    def unit_scores(self, job: WidthJob, i: int, kind: str) -> tuple[torch.Tensor, object]:
        ad, stats = job.adapter, job.stats
        if kind == "heads":
            geo = ad.head_geometry(i)
            o = ad.attn_projections(i)["o"]
            units = S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim, job.cfg.heads)
            col = self.columns(weight_out_in(o).detach(), stats[i]["o"] if stats else None,
                               job)
            s = S.unit_scores(col, units, self.head_reduce)
        else:
            down = ad.mlp_projections(i)["down"]
            s = self.channel_values(self.columns(weight_out_in(down).detach(),
                                                 stats[i]["down"] if stats else None, job))
        return s, self.protect(s)


def samples_field(default: int = 4):
    return field(default=default, metadata={
        "cli": "ablation_samples", "help": "windows for ablation-kl / putri / cocurve"})


def channel_group_field(default: int = 64):
    return field(default=default, metadata={
        "help": "FFN channels per ablation / cocurve unit"})


def check_ablation(samples: int, channel_group: int) -> None:
    check_range("ablation_samples", samples, 1, None, integer=True)
    check_range("channel_group", channel_group, 1, None, integer=True)
