"""``global``: units compete across blocks, cheapest score first, until the parameter
budget is met (per-block widths: the checkpoint needs ``trust_remote_code=True``)."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.errors import ConfigError
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS, WidthAllocation
from prunelab.pruning.width.plan import min_steps_left


@WIDTH_ALLOCATIONS.register("global")
@dataclass(frozen=True)
class Global(WidthAllocation):
    """units compete across blocks (per-block widths, needs trust_remote_code)"""

    uniform = False

    def counts(self, job, steps, kind):
        return global_counts(job.lm, job.cfg, steps, kind, job.budget)


def global_counts(lm, cfg, steps: list, kind: str, budget: int) -> list[int]:
    """Cheapest-score-first across blocks (each block's steps in order) until ``budget``
    parameters are removed; FFN counts are then rounded to keep multiples of
    ``round_to``."""
    ad = lm.adapter
    flat = sorted((st for blk in steps for st in blk), key=lambda st: (st.score, st.block))
    taken = [0] * ad.num_blocks
    limit = [len(blk) - min_steps_left(ad, cfg, i, kind) for i, blk in enumerate(steps)]
    removed = 0
    for st in flat:
        if removed >= budget:
            break
        i = st.block
        if taken[i] >= limit[i]:
            continue
        taken[i] += 1
        removed += st.cost
    if kind == "ffn":
        taken = [ad.ffn_width(i) - S.round_width(ad.ffn_width(i), ad.ffn_width(i) - t,
                                                  cfg.round_to) for i, t in enumerate(taken)]
    if not any(taken):
        raise ConfigError("the budget removes no unit: ask for more")
    return taken
