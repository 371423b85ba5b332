"""The contract of a depth recovery: repair the residual stream at every cut.

A recovery is a frozen dataclass registered in :data:`RECOVERIES` under its CLI name; its
fields are its own parameters (``metadata={"help": ...}``). After the blocks are deleted,
:func:`prunelab.pruning.depth.recovery.recover` walks the shortened model block by block on the
calibration windows and, at each cut, calls :meth:`Recovery.at_block` (the last kept block
before the cut, new numbering) or :meth:`Recovery.at_embeddings` (a cut starting at block
0) with that module's inputs and the dense model's hidden state after the removed span
(the target). Cuts are repaired in order, each seeing the repaired model's actual state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.errors import UnsupportedOperationError
from prunelab.registry import Registry, check_range

#: Depth recoveries by name ("none", "foldable", "boundary", "ghost", "lra").
RECOVERIES = Registry("recovery")


def ridge_field(default: float = 1e-6):
    """The ridge of a recovery's least squares (times the mean diagonal of the Gram)."""
    return field(default=default, metadata={
        "help": "ridge of the least-squares fit, times the mean diagonal of X^T X"})


@dataclass(frozen=True)
class Recovery:
    """Base of the registered recoveries."""

    #: False for ``none``: nothing is fitted (no calibration pass)
    fits: ClassVar[bool] = True
    #: checkpoints carry a modeling file (``trust_remote_code=True``)
    needs_remote_code: ClassVar[bool] = False
    #: can repair a cut at the embeddings (blocks from 0 removed)
    repairs_embeddings: ClassVar[bool] = False

    def check(self, adapter, index: int) -> None:
        """Refuse a cut after block ``index`` (new numbering; -1: the embeddings) before
        any calibration work."""
        if index < 0 and not self.repairs_embeddings:
            raise UnsupportedOperationError(
                f"{RECOVERIES.name_of(self)} recovery needs a kept block before the cut; "
                "blocks from 0 were removed (use ghost or lra)")

    def at_embeddings(self, runner, xs: list[torch.Tensor], targets: list[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], dict]:
        """Repair a cut at the embeddings' output ``xs``: the new block-0 inputs and fit
        statistics (``error_before``, ``error_after``)."""
        raise TypeError(f"{type(self).__name__} does not define at_embeddings()")

    def at_block(self, runner, index: int, inputs: list[torch.Tensor],
                 targets: list[torch.Tensor]) -> dict:
        """Repair the cut after block ``index`` (its inputs over every batch); returns fit
        statistics (``error_before``, ``error_after``: summed squared error at the cut)."""
        raise TypeError(f"{type(self).__name__} does not define at_block()")


def check_ridge(ridge: float) -> None:
    check_range("ridge", ridge, 0.0, 1.0)


def cut_error(xs, ys) -> float:
    """Summed squared difference of two lists of batches (float64)."""
    return sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(xs, ys,
                                                                           strict=True))
