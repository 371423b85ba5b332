"""The pruner of every sparsity method: registered once for
:class:`~prunelab.pruning.sparsity.config.SparsityConfig`, so a new method subclassing it
needs only its own registration in :data:`~prunelab.pruning.base.METHODS`."""

from __future__ import annotations

from prunelab.pruning.base import EXPERTS, FACTORED, PRUNERS, TOKENS, Pruner
from prunelab.pruning.sparsity.config import SparsityConfig
from prunelab.pruning.sparsity.execute import (
    SparsityReport,
    check_sparsity_config,
    prune_sparsity,
)


@PRUNERS.register(SparsityConfig)
class SparsityPruner(Pruner):
    """Unstructured / N:M sparsity, block by block (:func:`prune_sparsity`)."""

    operation = "prune-sparsity"
    refuses_kinds = FACTORED | EXPERTS | TOKENS

    def precheck(self, lm, config: SparsityConfig) -> None:
        """The method's own pre-checks (QK-Wanda: separate q/k projections), then a
        ``targets`` / ``ignore`` selection that holds no linear."""
        check_sparsity_config(lm, config)

    def run(self, lm, config: SparsityConfig, input_ids, *, batch_size: int
            ) -> SparsityReport:
        return prune_sparsity(lm, config, input_ids, batch_size=batch_size)
