"""``flap`` (An et al. 2024, AAAI, "Fluctuation-based Adaptive Structured Pruning"): the
input fluctuation ``var(X_j) * ||W_:j||^2``; standardised per block when units compete
across blocks."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.width import scores as S
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore


@WIDTH_SCORES.register("flap")
@dataclass(frozen=True)
class Flap(ColumnScore):
    """FLAP fluctuation: input variance times column energy"""

    standardise_global = True

    def needs_stats(self, unit):
        return True

    def columns(self, w, accs, job):
        return S.flap_columns(w, accs[1].var())
