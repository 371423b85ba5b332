"""``uniform``: every block removes the same share of its units (rounded to whole units; FFN
widths kept at multiples of ``round_to``), so a plain config holds the result."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.errors import ConfigError
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS, WidthAllocation
from prunelab.pruning.width.plan import unit_params


@WIDTH_ALLOCATIONS.register("uniform")
@dataclass(frozen=True)
class Uniform(WidthAllocation):
    """every block keeps the same counts (plain config)"""

    uniform = True

    def counts(self, job, steps, kind):
        return uniform_counts(job.lm, job.cfg, kind, job.budget)


def uniform_counts(lm, cfg, kind: str, budget: int) -> list[int]:
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
