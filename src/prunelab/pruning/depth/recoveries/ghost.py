"""``ghost`` (Ghosted Layers): ``W = I + M`` with ``(X^T X + eps I) M = X^T (Y - X)``, no
bias; optionally token-aware (a separate map for the first position, after the VGGT layer
study)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.depth.recoveries.base import RECOVERIES
from prunelab.pruning.depth.recoveries.linear_bridge import BridgeRecovery


@RECOVERIES.register("ghost")
@dataclass(frozen=True)
class Ghost(BridgeRecovery):
    """Ghosted Layers: a full linear map over each removed span (remote code)"""

    kind = "ghost"
    bias = False
