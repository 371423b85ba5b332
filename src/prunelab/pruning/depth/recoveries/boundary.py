"""``boundary`` (XMerge-style local reconstruction; derived): re-fit the last kept block's
attention output and down projections by ridge least squares so its output matches the
dense state after the removed span; see :func:`prunelab.pruning.depth.recovery.fit_boundary`."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth.recoveries.base import RECOVERIES, Recovery, check_ridge, ridge_field
from prunelab.pruning.depth.recovery import check_additive, fit_boundary


@RECOVERIES.register("boundary")
@dataclass(frozen=True)
class Boundary(Recovery):
    """re-fit the last kept block's o and down projections to the dense state"""

    ridge: float = ridge_field()

    def __post_init__(self):
        check_ridge(self.ridge)

    def check(self, adapter, index):
        super().check(adapter, index)
        check_additive(adapter, index, "boundary")

    def at_block(self, runner, index, inputs, targets):
        return fit_boundary(runner, index, inputs, targets, self.ridge)
