"""``stable-rank`` (forward-free; circuits after Elhage et al. 2021, the stable rank of
Rudelson and Vershynin 2007, scored as an unpublished proposal suggests):
a query head's score is ``sqrt(sr(W_Q W_K^T) * sr(W_V W_O))`` with ``sr(M) = ||M||_F^2 /
||M||_2^2``, the stable rank of its QK and OV circuits (see
:mod:`prunelab.probes.head_weights`: the GQA mapping, and why low is removed first); a KV
group's score is the mean of its query heads' scores."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.probes.head_weights import block_head_scores
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, WidthScore


@WIDTH_SCORES.register("stable-rank")
@dataclass(frozen=True)
class StableRankScore(WidthScore):
    """weight-only stable rank of each head's QK and OV circuits (heads only)"""

    units = ("heads",)

    def block_scores(self, job, kind):
        ad, out = job.adapter, []
        for i in range(ad.num_blocks):
            geo = ad.head_geometry(i)
            s = block_head_scores(ad, i)["value"]
            if job.cfg.heads != "query":  # one unit per KV group: its query heads' mean
                s = s.view(geo.num_kv_heads, geo.group_size).mean(1)
            out.append((s, None))
        return out
