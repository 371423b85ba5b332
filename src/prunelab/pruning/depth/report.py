"""What depth pruning reports: :class:`DepthReport` (whole blocks; the sub-block plan's
report extends it)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning.base import MethodReport


@dataclass
class DepthReport(MethodReport):
    """What depth pruning did (block numbers 0-based, original numbering)."""

    removed_blocks: list
    kept_blocks: list
    num_blocks_before: int
    num_blocks_after: int
    selection: dict
    probe_layer_values: list | None
    recovery: str
    cuts: list
    calib_divergence: str
    calib_kl_before_recovery: float
    calib_kl_after_recovery: float
    calib_kl_last_before_recovery: float
    calib_kl_last_after_recovery: float
    needs_remote_code: bool
    block_evaluations: float

    def history(self) -> dict:
        return {"removed_blocks": self.removed_blocks, "recovery": self.recovery}
