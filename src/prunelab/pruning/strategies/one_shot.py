"""``one-shot``: the ``n`` blocks the probe scores most removable."""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.pruning import selection as sel
from prunelab.pruning.strategies.base import STRATEGIES, ScoredStrategy


@STRATEGIES.register("one-shot")
@dataclass(frozen=True)
class OneShot(ScoredStrategy):
    """the n lowest removability values of the probe"""

    def pick(self, job, result, values, how):
        return sel.one_shot(values, job.n)
