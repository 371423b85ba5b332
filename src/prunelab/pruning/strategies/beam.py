"""``beam``: beam search over removal sets, seeded with the ``seeds`` most removable blocks
of the probe; each candidate set is scored by the calibration KL (or perplexity) of the
dense model without it. Chen et al., "No Free Swap", use width 3 and 12 seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.log import progress
from prunelab.pruning.strategies.base import STRATEGIES, ScoredStrategy, SelectJob
from prunelab.registry import check_range

BEAM_SCORES = ("kl", "perplexity")


@STRATEGIES.register("beam")
@dataclass(frozen=True)
class Beam(ScoredStrategy):
    """beam search over removal sets scored by calibration KL or perplexity"""

    width: int = field(default=3, metadata={"cli": "beam_width", "help": "beam: width"})
    seeds: int = field(default=12, metadata={"cli": "beam_seeds",
                                             "help": "beam: candidate blocks"})
    score: str = field(default="kl", metadata={"cli": "beam_score",
                                               "help": "beam: kl or perplexity"})

    def __post_init__(self):
        check_range("beam width", self.width, 1, None, integer=True)
        check_range("beam seeds", self.seeds, 1, None, integer=True)
        if self.score not in BEAM_SCORES:
            raise ConfigError(f"beam score must be kl or perplexity, got {self.score!r}")

    def pick(self, job: SelectJob, result, values, how):
        chosen, how["beam"] = beam_search(job.ctx, values, job.n, self)
        return chosen


def _removal_cost(ctx, removed: tuple[int, ...], score: str) -> float:
    """KL (all positions) or NLL of the dense model without ``removed``, from the cached
    boundary before the first removed block."""
    start = min(removed)
    order = [b for b in range(start, ctx.num_blocks) if b not in removed]
    final = ctx.run_stack(start, order)
    return ctx.nll(final) if score == "perplexity" else ctx.divergence(final)[1]


def beam_search(ctx, values: list, n: int, beam: Beam) -> tuple[list[int], dict]:
    """Keep the ``beam.width`` cheapest sets of each size up to ``n``; candidates are the
    ``max(seeds, n)`` most removable blocks. Returns the best set and search statistics."""
    pool = [i for i in sorted(range(len(values)), key=lambda i: (values[i] is None, values[i]))
            if values[i] is not None][: max(beam.seeds, n)]
    beams: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    scored: dict[tuple[int, ...], float] = {}
    for _ in progress(range(n), total=n, desc="beam search"):
        cands = {tuple(sorted((*b, c))) for _, b in beams for c in pool if c not in b}
        for cand in cands:
            if cand not in scored:
                scored[cand] = _removal_cost(ctx, cand, beam.score)
        beams = sorted((scored[c], c) for c in cands)[: beam.width]
    best_cost, best = beams[0]
    return list(best), {"width": beam.width, "seeds": len(pool), "score": beam.score,
                        "best_cost": best_cost, "sets_scored": len(scored)}
