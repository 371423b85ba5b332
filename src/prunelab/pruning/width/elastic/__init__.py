"""Elastic models: one learned ranking of every unit for every budget (``elastic``
method, ``cut`` / ``elastic(lm).at(keep)``; ``prunelab export`` is
:mod:`prunelab.workflow.export`), BMuon training
(:mod:`prunelab.train.bmuon`)."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__)

from prunelab.pruning.width.elastic.fit import fit_ranking
from prunelab.pruning.width.elastic.method import (
    ElasticModel,
    ElasticRanking,
    cut,
    elastic,
)
from prunelab.pruning.width.elastic.ranking import (
    hard_keep,
    masked,
    model_units,
    soft_keep,
    threshold,
)
from prunelab.pruning.width.elastic.store import find_ranking

__all__ = ["ElasticModel", "ElasticRanking", "cut", "elastic", "find_ranking",
           "fit_ranking", "hard_keep", "masked", "model_units", "soft_keep",
           "threshold"]
