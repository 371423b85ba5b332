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
from pathlib import Path

import torch

from prunelab.checkpoint.save import register_save_extra
from prunelab.errors import ConfigError, CorruptCheckpointError
from prunelab.io.files import write_json
from prunelab.io.manifest import read_json_file, read_manifest
from prunelab.pruning.base import (
    FACTORED,
    METHODS,
    PRUNERS,
    SKIPPED,
    TOKENS,
    MethodReport,
    Pruner,
)
from prunelab.pruning.width.elastic.fit import FORMAT, fit_ranking
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


# ---------------------------------------------------------------- finding a ranking
def _matches(ranking: dict, ad, kind: str | None) -> bool:
    n = ad.num_blocks
    if len(ranking.get("blocks", [])) != n:
        return False
    ffn_ok = ranking["ffn_per_block"] == [ad.ffn_width(i) for i in range(n)]
    heads = ranking["heads_per_block"]
    heads_ok = not any(heads) or heads == [ad.head_geometry(i).num_kv_heads for i in range(n)]
    return {"ffn": ffn_ok, "heads": heads_ok}.get(kind, ffn_ok and heads_ok)


def _from_disk(lm) -> dict | None:
    for base in (getattr(lm, "source", None), getattr(lm, "spec", None)):
        if not base or not Path(str(base)).is_dir():
            continue
        path = Path(str(base)) / "elastic.json"
        if path.is_file():
            return check_ranking(read_json_file(path), str(path))
        man = read_manifest(Path(str(base)))
        if man is not None:
            for op in reversed(man.get("operations", [])):
                if isinstance(op.get("ranking"), dict):
                    return check_ranking(op["ranking"], f"{base}/manifest.json")
    return None


def check_ranking(ranking, where: str) -> dict:
    """``ranking`` if it has the shape :func:`fit_ranking` writes (format, per-block KV
    group and FFN channel counts, one finite score per unit); else a one-line
    :class:`CorruptCheckpointError` naming ``where`` (a truncated or edited file)."""
    import math

    def bad(why: str):
        return CorruptCheckpointError(f"{where}: not a usable elastic ranking ({why})")

    if not isinstance(ranking, dict):
        raise bad(f"a JSON {type(ranking).__name__}, not an object")
    if ranking.get("format") != FORMAT:
        raise bad(f"format {ranking.get('format')!r}, expected {FORMAT!r}")
    counts = {}
    for key in ("heads_per_block", "ffn_per_block", "blocks"):
        if not isinstance(ranking.get(key), list):
            raise bad(f"'{key}' must be a list")
    for key in ("heads_per_block", "ffn_per_block"):
        v = ranking[key]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v):
            raise bad(f"'{key}' must hold counts")
        counts[key] = v
    blocks = ranking["blocks"]
    if not (len(blocks) == len(counts["heads_per_block"]) == len(counts["ffn_per_block"])):
        raise bad(f"{len(blocks)} blocks of scores for {len(counts['ffn_per_block'])} "
                  "blocks of counts")
    for i, blk in enumerate(blocks):
        if not isinstance(blk, dict):
            raise bad(f"block {i} is not an object")
        for kind, n in (("heads", counts["heads_per_block"][i]),
                        ("ffn", counts["ffn_per_block"][i])):
            scores = blk.get(kind)
            if not isinstance(scores, list) or len(scores) != n:
                raise bad(f"block {i} needs {n} {kind} scores")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                       and math.isfinite(x) for x in scores):
                raise bad(f"block {i}: the {kind} scores must be finite numbers")
    return ranking


def find_ranking(lm, kind: str | None = None, path: str | None = None) -> dict | None:
    """The ranking that applies to ``lm``'s current shapes: ``path`` (an ``elastic.json``),
    else the one fitted on ``lm`` in this process, else ``elastic.json`` / the manifest of
    the checkpoint it was loaded from; ``None`` when there is none. A ranking whose shapes
    do not match (for ``kind``: ``heads``, ``ffn`` or both) is a :class:`ConfigError`."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"elastic ranking {path} does not exist")
        ranking = check_ranking(read_json_file(p), str(p))
    else:
        ranking = getattr(lm, "elastic_ranking", None) or _from_disk(lm)
    if ranking is None:
        return None
    if not _matches(ranking, lm.adapter, kind):
        raise ConfigError("the elastic ranking was fitted on other shapes (the model was "
                          "pruned since?): cut from the elastic checkpoint itself")
    return ranking


def ranking_to_save(lm) -> dict | None:
    """The ranking ``prunelab.save`` writes as ``elastic.json``: the model's own, and only
    while it still fits the model's shapes (a model pruned since is no elastic
    checkpoint)."""
    ranking = getattr(lm, "elastic_ranking", None)
    if ranking is None or not _matches(ranking, lm.adapter, None):
        return None
    return ranking


@register_save_extra
def write_ranking(lm, folder: Path) -> None:
    """Checkpoint hook: an elastic model's ranking as ``elastic.json`` beside its weights."""
    if (ranking := ranking_to_save(lm)) is not None:
        write_json(folder / "elastic.json", ranking)


def block_tensors(ranking: dict, kind: str) -> list[torch.Tensor]:
    return [torch.tensor(b[kind], dtype=torch.float64) for b in ranking["blocks"]]


# ---------------------------------------------------------------- cutting
def cut(lm, keep: float, allocation: str = "global", round_to: int = 8) -> dict:
    """Cut ``lm`` in place to keep ``keep`` of its units' parameters (KV groups' attention
    and FFN channels' MLP parameters), by its elastic ranking, through
    :func:`~prunelab.pruning.width.execute.run_width` (no calibration: no refit, no bias
    compensation). ``allocation``: ``global`` (one threshold over every unit: per-block
    widths, a remote-code checkpoint) or ``uniform`` (heads and channels each cut by the
    same share in every block, ranked within blocks: a plain checkpoint). Returns the
    width report(s); ``keep == 1`` changes nothing."""
    from prunelab.pruning.width.config import Width
    from prunelab.pruning.width.execute import run_width
    from prunelab.pruning.width.scoring.elastic import ElasticScore

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
        from prunelab.models.loading import wrap

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


