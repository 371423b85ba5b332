"""``span``: the best contiguous span of ``n`` blocks (a span/interval probe's own distance,
else the lowest summed removability)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy


@STRATEGIES.register("span")
@dataclass(frozen=True)
class Span(ScoredStrategy):
    """the best contiguous span of n blocks (default for span/interval probes; from block 1 when the recovery cannot repair the embeddings)"""  # noqa: E501

    def pick(self, job, result, values, how):
        rec = getattr(job.cfg, "recovery", None)
        first = 1 if rec is not None and rec.fits and not rec.repairs_embeddings else 0
        if result.kind in ("span", "interval"):
            return sel.span_from_scores(result.scores, job.n, first)
        return sel.best_span(values, job.n, first)
