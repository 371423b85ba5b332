"""``lra`` (linear residual adapter, SHIFT-LLM; derived): an affine ``x -> x + x M + b`` over
each removed span by ridge least squares; with ``rank`` the reduced-rank solution stored as
two factors (see :func:`prunelab.models.bridges.reduced_rank`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.pruning.depth.recoveries.base import RECOVERIES
from prunelab.pruning.depth.recoveries.linear_bridge import BridgeRecovery
from prunelab.registry import check_range


@RECOVERIES.register("lra")
@dataclass(frozen=True)
class Lra(BridgeRecovery):
    """linear residual adapter: affine map, optionally low rank (remote code)"""

    rank: int | None = field(default=None, metadata={"help": "lra: rank of the adapter"})

    kind = "lra"
    bias = True

    def __post_init__(self):
        super().__post_init__()
        if self.rank is not None:
            check_range("rank", self.rank, 1, None, integer=True)

    @property
    def bridge_rank(self) -> int | None:
        return self.rank
