"""Structured width pruning: KV groups / heads / query heads and FFN channels removed
physically, scored by a registered width score (wanda-sp, magnitude profile, FLAP,
ablation KL, Putri, or jointly by CoCurve) under a registered allocation (uniform,
global), with least-squares compensation of the consumer projections."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("config",))

from prunelab.pruning.width.allocation import WIDTH_ALLOCATIONS, Global, Uniform, WidthAllocation
from prunelab.pruning.width.config import Width, width_from_cli
from prunelab.pruning.width.scoring import (
    WIDTH_SCORES,
    AblationKL,
    CoCurve,
    ColumnScore,
    Flap,
    MagnitudeProfile,
    Putri,
    WandaSP,
    WidthScore,
)

__all__ = ["WIDTH_ALLOCATIONS", "WIDTH_SCORES", "AblationKL", "CoCurve", "ColumnScore", "Flap",
           "Global", "MagnitudeProfile", "Putri", "Uniform", "WandaSP", "Width",
           "WidthAllocation", "WidthScore", "width_from_cli"]
