"""Width scores, one module each, registered in :data:`WIDTH_SCORES`.

Adding one: a new module with a frozen dataclass registered with
``@WIDTH_SCORES.register("name")`` deriving from :class:`ColumnScore` (implement
``columns``) or :class:`WidthScore` (``block_scores`` or ``plan``), declaring its
``units`` and what it needs; the package imports it (or import it from anywhere before use).
"""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=(
    "wanda_sp", "magnitude_profile", "flap", "ablation_kl", "putri", "cocurve", "rep_lie",
    "stable_rank", "elastic",
))

from prunelab.pruning.width.scoring.ablation_kl import AblationKL
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore, WidthScore
from prunelab.pruning.width.scoring.cocurve import CoCurve
from prunelab.pruning.width.scoring.elastic import ElasticScore
from prunelab.pruning.width.scoring.flap import Flap
from prunelab.pruning.width.scoring.magnitude_profile import MagnitudeProfile
from prunelab.pruning.width.scoring.putri import Putri
from prunelab.pruning.width.scoring.rep_lie import RepLie
from prunelab.pruning.width.scoring.stable_rank import StableRankScore
from prunelab.pruning.width.scoring.wanda_sp import WandaSP

__all__ = ["WIDTH_SCORES", "AblationKL", "CoCurve", "ColumnScore", "ElasticScore", "Flap",
           "MagnitudeProfile", "Putri", "RepLie", "StableRankScore", "WandaSP", "WidthScore"]
