"""``magnitude-profile`` (weight only): a unit's contribution norm ``sqrt(sum W^2)`` over its
consumer columns; robust outliers (``|s - median| > outlier_z * 1.4826 MAD``) are kept and
the bulk is pruned lowest first."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.pruning.width import scores as S
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore
from prunelab.registry import check_range


@WIDTH_SCORES.register("magnitude-profile")
@dataclass(frozen=True)
class MagnitudeProfile(ColumnScore):
    """weight-only contribution norm; outlier units are kept"""

    outlier_z: float = field(default=3.0, metadata={
        "help": "magnitude-profile: units beyond this many robust deviations are kept "
                "(0: none)"})

    head_reduce = "norm"

    def __post_init__(self):
        check_range("outlier_z", self.outlier_z, 0.0, None)

    def columns(self, w, accs, job):
        return S.magnitude_columns(w)

    def channel_values(self, columns):
        return columns.sqrt()

    def protect(self, scores):
        return S.outliers(scores, self.outlier_z)
