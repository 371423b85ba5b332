"""The ``elastic`` method: fit the ranking once, cut any size from it in seconds.

``prunelab.prune(lm, ElasticRanking(budget_min=0.1, budget_max=0.6), data)`` learns the
ranking (:mod:`prunelab.pruning.width.elastic.ranking`) and leaves the weights dense;
``prunelab.save`` then writes an *elastic checkpoint*: the dense weights, the ranking in
the manifest (the operation's history entry) and in ``elastic.json`` beside the weights.
:func:`cut` (``elastic(lm).at(keep)`` on a copy) removes units physically through the
width machinery (:class:`~prunelab.pruning.width.config.Width` with the ``elastic`` width
score, unit ``joint`` under the ``global`` allocation, or heads and channels each
``uniform``), with no calibration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.base import (
    FACTORED,
    METHODS,
    PRUNERS,
    SKIPPED,
    TOKENS,
    MethodReport,
    Pruner,
)
from prunelab.pruning.width.config import Width
from prunelab.pruning.width.elastic.fit import fit_ranking
from prunelab.pruning.width.elastic.store import find_ranking
from prunelab.pruning.width.execute import run_width
from prunelab.pruning.width.scoring.elastic import ElasticScore
from prunelab.registry import check_range, to_dict


def _help(text: str, default, **more):
    return field(default=default, metadata={"help": text, **more})


@METHODS.register("elastic")
@dataclass(frozen=True)
class ElasticRanking:
    """Learn one ranking of every KV group and FFN channel for every budget in
    ``[budget_min, budget_max]`` (fractions of the units' parameters removed); the
    weights stay dense (an elastic checkpoint)."""

    budget_min: float = _help("smallest removal budget trained (fraction of the units' "
                              "parameters)", 0.1, budget="remove-units", span="low")
    budget_max: float = _help("largest removal budget trained", 0.6, budget="remove-units",
                              span="high")
    steps: int = _help("optimisation steps", 200)
    lr: float = _help("Adam learning rate of the scores", 0.05)
    budgets_per_step: int = _help("budgets drawn per step", 2)
    t_start: float = _help("initial temperature (standardised score units)", 1.0)
    t_end: float = _help("final temperature", 0.05)
    seed: int = _help("budget draws", 0)

    def __post_init__(self):
        check_range("budget_min", self.budget_min, 0.0, 0.95)
        check_range("budget_max", self.budget_max, 0.0, 0.95)
        if self.budget_min > self.budget_max:
            raise ConfigError(f"budget_min {self.budget_min:g} is above budget_max "
                              f"{self.budget_max:g}")
        check_range("steps", self.steps, 1, 10**6, integer=True)
        check_range("lr", self.lr, 1e-8, 100.0)
        check_range("budgets_per_step", self.budgets_per_step, 1, 64, integer=True)
        check_range("t_start", self.t_start, 1e-6, 100.0)
        check_range("t_end", self.t_end, 1e-6, 100.0)
        if self.t_end > self.t_start:
            raise ConfigError(f"t_end {self.t_end:g} is above t_start {self.t_start:g}: the "
                              "temperature anneals downwards (give t_end <= t_start)")
        check_range("seed", self.seed, 0, 2**31 - 1, integer=True)

    def fit_kwargs(self) -> dict:
        return {"budgets": (self.budget_min, self.budget_max), "steps": self.steps,
                "lr": self.lr, "budgets_per_step": self.budgets_per_step,
                "t_start": self.t_start, "t_end": self.t_end, "seed": self.seed}


@dataclass
class ElasticReport(MethodReport):
    units: int
    fit: dict
    ranking: dict = field(repr=False)

    def to_dict(self) -> dict:
        return {"units": self.units, "fit": self.fit, "elastic_checkpoint": True}

    def history(self) -> dict:
        return {"ranking": self.ranking}


@PRUNERS.register(ElasticRanking)
class ElasticPruner(Pruner):
    operation = "prune-elastic"
    refuses_kinds = FACTORED | SKIPPED | TOKENS

    def run(self, lm, config: ElasticRanking, input_ids, *, batch_size: int) -> ElasticReport:
        ranking = fit_ranking(lm, input_ids, batch_size=batch_size, **config.fit_kwargs())
        lm.elastic_ranking = ranking
        n = sum(ranking["heads_per_block"]) + sum(ranking["ffn_per_block"])
        return ElasticReport(units=n, fit=ranking["fit"], ranking=ranking)


# ---------------------------------------------------------------- cutting
def cut(lm, keep: float, allocation: str = "global", round_to: int = 8) -> dict:
    """Cut ``lm`` in place to keep ``keep`` of its units' parameters (KV groups' attention
    and FFN channels' MLP parameters), by its elastic ranking, through
    :func:`~prunelab.pruning.width.execute.run_width` (no calibration: no refit, no bias
    compensation). ``allocation``: ``global`` (one threshold over every unit: per-block
    widths, a remote-code checkpoint) or ``uniform`` (heads and channels each cut by the
    same share in every block, ranked within blocks: a plain checkpoint). Returns the
    width report(s); ``keep == 1`` changes nothing."""
    check_range("keep", keep, 0.05, 1.0)
    if allocation not in ("global", "uniform"):
        raise ConfigError(f"allocation must be global or uniform, got {allocation!r}")
    ranking = find_ranking(lm)
    if ranking is None:
        raise ConfigError(f"{lm.spec} has no elastic ranking: run prune elastic first")
    lm.elastic_ranking = ranking
    if keep >= 1.0:
        return {"keep": 1.0, "reports": []}
    ids = torch.zeros((1, 1), dtype=torch.long)
    kinds = ["joint"] if allocation == "global" else \
        [k for k in ("heads", "ffn") if k == "ffn" or any(ranking["heads_per_block"])]
    reports = []
    for kind in kinds:
        cfg = Width(unit=kind, score=ElasticScore(), ratio=round(1.0 - keep, 6),
                    allocation=allocation, bias_compensation=False, round_to=round_to)
        report = run_width(lm, cfg, ids)
        lm.history.append({"operation": "prune-width", "method": "width",
                           "config": to_dict(cfg), "elastic_keep": keep,
                           "removed_params": report.removed_params})
        reports.append(report.to_dict())
    lm.elastic_ranking = None  # the shapes changed: the ranking no longer applies
    return {"keep": keep, "allocation": allocation, "reports": reports}


class ElasticModel:
    """``elastic(lm).at(0.5)``: a physically cut copy of ``lm`` per size, from its ranking
    (``lm`` itself is never changed)."""

    def __init__(self, lm, allocation: str = "global", round_to: int = 8):
        self.lm = lm
        self.allocation = allocation
        self.round_to = round_to
        self.ranking = find_ranking(lm)
        if self.ranking is None:
            raise ConfigError(f"{lm.spec} has no elastic ranking: run prune elastic first")

    def at(self, keep: float):
        """A copy of the model keeping ``keep`` of the units' parameters."""
        small = wrap(copy.deepcopy(self.lm.model), self.lm.tokenizer)
        for name in ("spec", "source", "dtype", "device"):
            setattr(small, name, getattr(self.lm, name))
        small.history = [{k: v for k, v in op.items() if k != "ranking"}
                         for op in copy.deepcopy(self.lm.history)]
        small.size_before = getattr(self.lm, "size_before", None)
        small.elastic_ranking = self.ranking
        cut(small, keep, self.allocation, self.round_to)
        return small


def elastic(lm, allocation: str = "global", round_to: int = 8) -> ElasticModel:
    """The elastic view of a model with a ranking (see :class:`ElasticModel`)."""
    return ElasticModel(lm, allocation, round_to)


