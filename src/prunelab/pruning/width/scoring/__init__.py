"""Width scores, one module each, registered in :data:`WIDTH_SCORES`.

Adding one: a new module with a frozen dataclass registered with
``@WIDTH_SCORES.register("name")`` deriving from :class:`ColumnScore` (implement
``columns``) or :class:`WidthScore` (``block_scores`` or ``plan``), declaring its
``units`` and what it needs, imported below (or from anywhere before use).
"""

from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore, WidthScore

# registration order = the order of CLI lists and error messages
# isort: off
from prunelab.pruning.width.scoring.wanda_sp import WandaSP
from prunelab.pruning.width.scoring.magnitude_profile import MagnitudeProfile
from prunelab.pruning.width.scoring.flap import Flap
from prunelab.pruning.width.scoring.ablation_kl import AblationKL
from prunelab.pruning.width.scoring.putri import Putri
from prunelab.pruning.width.scoring.cocurve import CoCurve
from prunelab.pruning.width.scoring.rep_lie import RepLie
from prunelab.pruning.width.scoring.stable_rank import StableRankScore
from prunelab.pruning.width.scoring.elastic import ElasticScore
# isort: on

__all__ = ["WIDTH_SCORES", "AblationKL", "CoCurve", "ColumnScore", "ElasticScore", "Flap",
           "MagnitudeProfile", "Putri", "RepLie", "StableRankScore", "WandaSP", "WidthScore"]
