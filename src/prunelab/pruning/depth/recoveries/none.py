"""``none``: delete the blocks, repair nothing."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth.recoveries.base import RECOVERIES, Recovery


@RECOVERIES.register("none")
@dataclass(frozen=True)
class NoRecovery(Recovery):
    """no repair"""

    fits = False
