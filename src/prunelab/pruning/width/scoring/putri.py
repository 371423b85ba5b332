"""``putri`` (derived). FFN channels: a curvature-weighted saliency of the ``down``
projection's columns (SparseGPT-style OBS term, Frantar & Alistarh 2023, weighted by
output-channel energy; ridge ``max(Width.damp, 0.01)``). Heads: KV groups removed round
by round, ``per_round`` at a time, each round masking every remaining group on top of
those removed and taking the ones whose masking raises the perplexity of one calibration
window least."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.calib.ablation import Unit, putri_rounds
from prunelab.errors import ConfigError
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.allocation.uniform import uniform_counts
from prunelab.pruning.width.plan import group_cost, kv_group_units
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore
from prunelab.registry import check_range


@WIDTH_SCORES.register("putri")
@dataclass(frozen=True)
class Putri(ColumnScore):
    """ffn: curvature-weighted saliency; heads: KV groups removed round by round"""

    per_round: int = field(default=1, metadata={
        "cli": "putri_per_round", "help": "putri heads: KV groups removed per round"})

    def __post_init__(self):
        check_range("putri_per_round", self.per_round, 1, None, integer=True)

    def validate(self, cfg):
        if cfg.unit == "heads" and cfg.heads == "query":
            raise ConfigError("putri removes whole KV groups round by round: use "
                              "--heads groups")

    def needs_lm_head(self, unit):
        return unit == "heads"

    def needs_stats(self, unit):
        return unit == "ffn"

    def needs_gram(self, unit):
        return unit == "ffn"

    def columns(self, w, accs, job):
        return S.putri_columns(w, accs[2].xtx, damp=max(job.cfg.damp, 1e-2))

    def plan(self, job):
        return putri_heads(job, self) if job.cfg.unit == "heads" else super().plan(job)


def putri_heads(job, score: Putri) -> dict:
    """Fill the plans with the KV groups Putri's rounds keep (see module); uniform
    allocation: every block loses the same number of groups."""
    ad, cfg, budget = job.adapter, job.cfg, job.budget
    units, where = [], []
    for i, g, o, cols in kv_group_units(ad, range(ad.num_blocks)):
        units.append(Unit(i, o, cols))
        where.append((i, g, group_cost(ad, i)))
    if cfg.allocation.uniform:
        per_block = uniform_counts(job.lm, cfg, "heads", budget)
        n_remove = sum(per_block)

        def allowed(removed, u):
            i = where[u][0]
            return sum(where[r][0] == i for r in removed) < per_block[i]
    else:
        n_remove = len(units)

        def allowed(removed, u):
            i = where[u][0]
            spent = sum(where[r][2] for r in removed)
            left = ad.head_geometry(i).num_kv_heads - sum(where[r][0] == i for r in removed)
            return spent < budget and left > 1
    log = putri_rounds(job.lm, job.input_ids[:1], units, n_remove, allowed,
                       per_round=score.per_round)
    gone = {(where[u][0], where[u][1]) for u, _ in log}
    for i in range(ad.num_blocks):
        job.plans[i].groups = [g for g in range(ad.head_geometry(i).num_kv_heads)
                               if (i, g) not in gone]
    return {"putri_rounds": [{"block": where[u][0], "group": where[u][1], "perplexity": p}
                             for u, p in log]}
