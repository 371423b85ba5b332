"""``foldable`` (ReplaceMe, Shopkhoev et al. 2025): a linear map of the last kept block's MLP
output, fitted by ridge least squares and folded into its down projection (a vanilla
checkpoint, no extra parameters); see :func:`prunelab.pruning.depth.recovery.fit_foldable`."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth.recoveries.base import RECOVERIES, Recovery, check_ridge, ridge_field
from prunelab.pruning.depth.recovery import check_additive, fit_foldable


@RECOVERIES.register("foldable")
@dataclass(frozen=True)
class Foldable(Recovery):
    """ReplaceMe: a linear map folded into the last kept block's down projection"""

    ridge: float = ridge_field()

    def __post_init__(self):
        check_ridge(self.ridge)

    def check(self, adapter, index):
        super().check(adapter, index)
        check_additive(adapter, index, "foldable")

    def at_block(self, runner, index, inputs, targets):
        return fit_foldable(runner, index, inputs, targets, self.ridge)
