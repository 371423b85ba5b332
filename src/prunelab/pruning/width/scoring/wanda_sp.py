"""``wanda-sp`` (An et al. 2024, FLAP's baseline after Sun et al. 2024): ``mean_i |W_ij| *
||X_j||`` per consumer input column."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.width import scores as S
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore


@WIDTH_SCORES.register("wanda-sp")
@dataclass(frozen=True)
class WandaSP(ColumnScore):
    """mean |W| times the input norm, per consumer column"""

    def needs_stats(self, unit):
        return True

    def columns(self, w, accs, job):
        return S.wanda_sp_columns(w, accs[0].sum_sq)
