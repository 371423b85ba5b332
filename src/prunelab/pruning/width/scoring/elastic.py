"""``elastic``: the learned elastic ranking (:mod:`prunelab.pruning.width.elastic.ranking`: a
differentiable relaxation of the functional unit-ranking problem) as a width
score. It reads the ranking of the model (fitted in this process, ``ranking=PATH``, or the
``elastic.json`` of the elastic checkpoint it was loaded from) or fits one on the
calibration windows. Units ``heads`` (KV groups), ``ffn`` and ``joint`` (every unit under
one threshold: the scores share one scale).

The elastic pieces are imported where they are used: importing
:mod:`prunelab.pruning.width.elastic` runs its ``__init__``, which registers its method
module, which needs :mod:`prunelab.pruning.width.config` -- the module that imports this
one while it initialises."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.plan import channel_cost, group_cost
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, WidthScore
from prunelab.registry import check_range


@WIDTH_SCORES.register("elastic")
@dataclass(frozen=True)
class ElasticScore(WidthScore):
    """learned ranking of every unit for every budget (reads or fits it)"""

    ranking: str = field(default="", metadata={
        "cli": "elastic_ranking", "help": "elastic: an elastic.json to read (default: the "
                                          "model's own, else fit one)"})
    steps: int = field(default=200, metadata={
        "cli": "elastic_steps", "help": "elastic: fit steps when no ranking is found"})

    units = ("heads", "ffn", "joint")

    def __post_init__(self):
        check_range("elastic_steps", self.steps, 1, 10**6, integer=True)

    def validate(self, cfg) -> None:
        if cfg.heads != "groups":
            raise ConfigError("the elastic ranking scores KV groups: use --heads groups")

    def _ranking(self, job, kind):
        from prunelab.pruning.width.elastic.fit import fit_ranking  # noqa: PLC0415 - see top
        from prunelab.pruning.width.elastic.store import find_ranking  # noqa: PLC0415

        found = find_ranking(job.lm, kind, self.ranking or None)
        if found is None:
            found = fit_ranking(job.lm, job.input_ids, steps=self.steps,
                                batch_size=job.batch_size)
        if kind == "heads" and not any(found["heads_per_block"]):
            raise ConfigError("the elastic ranking has no heads (multi-query model)")
        return found

    def block_scores(self, job, kind):
        from prunelab.pruning.width.elastic.store import block_tensors  # noqa: PLC0415

        return [(s, None) for s in block_tensors(self._ranking(job, kind), kind)]

    def plan(self, job):
        if job.cfg.unit != "joint":
            return super().plan(job)
        return plan_joint(job, self._ranking(job, "joint"))


def plan_joint(job, ranking: dict) -> dict:
    """Every unit ascending by score, taken while the removed parameters are below the
    budget (a block keeps one KV group and ``round_to`` channels); FFN widths then rounded
    to multiples of ``round_to`` (giving back the best-scored removed channels, or taking
    the worst-scored kept ones)."""
    from prunelab.pruning.width.elastic.store import block_tensors  # noqa: PLC0415

    ad, cfg = job.adapter, job.cfg
    heads, ffn = block_tensors(ranking, "heads"), block_tensors(ranking, "ffn")
    flat = [(float(s), i, "heads", u, group_cost(ad, i)) for i, h in enumerate(heads)
            for u, s in enumerate(h.tolist())]
    flat += [(float(s), i, "ffn", u, channel_cost(ad, i)) for i, f in enumerate(ffn)
             for u, s in enumerate(f.tolist())]
    flat.sort(key=lambda t: t[0])
    gone = {(i, k): set() for i in range(ad.num_blocks) for k in ("heads", "ffn")}
    removed = 0
    for _s, i, kind, u, cost in flat:
        if removed >= job.budget:
            break
        left = (len(heads[i]) if kind == "heads" else ad.ffn_width(i)) - len(gone[i, kind])
        if left - 1 < (1 if kind == "heads" else min(cfg.round_to, ad.ffn_width(i))):
            continue
        gone[i, kind].add(u)
        removed += cost
    for i in range(ad.num_blocks):
        if len(heads[i]):
            job.plans[i].groups = [g for g in range(len(heads[i])) if g not in gone[i, "heads"]]
        job.plans[i].ffn = _rounded(ffn[i], gone[i, "ffn"], cfg.round_to)
    return {"elastic": {"removed_unit_params": removed, "fit": ranking.get("fit", {})}}


def _rounded(scores, gone: set, multiple: int) -> list[int]:
    width = len(scores)
    keep = [c for c in range(width) if c not in gone]
    target = S.round_width(width, len(keep), multiple)
    best = lambda cs: sorted(cs, key=lambda c: -float(scores[c]))  # noqa: E731
    if target < len(keep):
        return sorted(best(keep)[:target])
    return sorted(set(keep) | set(best(gone)[:target - len(keep)]))
