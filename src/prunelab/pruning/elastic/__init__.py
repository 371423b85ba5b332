"""Elastic models: one learned ranking of every unit for every budget (``elastic``
method, ``cut`` / ``elastic(lm).at(keep)`` / ``export``), BMuon training
(:mod:`prunelab.pruning.elastic.bmuon`)."""

from prunelab.pruning.elastic.fit import fit_ranking
from prunelab.pruning.elastic.method import (
    ElasticModel,
    ElasticRanking,
    cut,
    elastic,
    export,
    find_ranking,
    parse_budgets,
)
from prunelab.pruning.elastic.ranking import hard_keep, masked, model_units, soft_keep, threshold

__all__ = ["ElasticModel", "ElasticRanking", "cut", "elastic", "export", "find_ranking",
           "fit_ranking", "hard_keep", "masked", "model_units", "parse_budgets", "soft_keep",
           "threshold"]
