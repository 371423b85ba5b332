"""Held-out scoring of recovery in the loop: fit each candidate's closed-form repair on part
of the calibration windows and score the candidate on the rest.

A least-squares repair fitted and scored on the same few windows rewards fits that match
those windows and generalise badly (measured on SmolLM2-135M with 8 calibration windows:
the in-loop search chose cuts with a lower calibration KL and a much worse test
perplexity). Scoring each candidate on windows its fit has not seen is the usual remedy
(a validation split, as in model selection by cross-validation).

The split is by calibration batch (the block runner replays each batch with its own
recorded arguments): ``round(fraction x batches)`` batches (at least one), evenly spread,
are held out for scoring; the others fit. Raw and repaired scores of a candidate are both
taken on the held-out batches, so they stay comparable. The applied model is repaired on
all windows, as without a holdout.
"""

from __future__ import annotations

import contextlib

from prunelab.errors import ConfigError
from prunelab.pruning.depth.removal_plan import (
    EmbeddingFix,
    Plan,
    PlanScorer,
    Scored,
    cut_block,
    cuts_of,
)


def holdout_split(n_batches: int, fraction: float) -> tuple[list[int], list[int]]:
    """``(fit, score)`` batch indices for a held-out ``fraction`` of ``n_batches``
    (disjoint, together all batches; ``fraction == 0``: both all)."""
    every = list(range(n_batches))
    if fraction <= 0:
        return every, every
    if n_batches < 2:
        raise ConfigError(f"recovery_holdout {fraction} needs at least 2 calibration batches, "
                          f"got {n_batches} (more --samples or --search-windows, or a smaller "
                          "--batch-size)")
    k = min(max(1, round(fraction * n_batches)), n_batches - 1)
    score = sorted({int((i + 1) * n_batches / k) - 1 for i in range(k)})
    return [b for b in every if b not in score], score


@contextlib.contextmanager
def only_batches(ctx, idx: list[int]):
    """Within the block, ``ctx`` (its runner, NLL and divergence) sees only the calibration
    batches ``idx``, renumbered ``0..``: hidden-state lists passed in must be subset alike
    (:func:`pick`). Block evaluations keep counting batch calls (read them outside)."""
    runner = ctx.runner
    runner.ensure_captured()
    batches, calls = runner.batches, runner.calls
    ref = ctx._ref
    runner.batches = [batches[i] for i in idx]
    runner.calls = [[c[i] for i in idx] for c in calls]
    ctx._ref = lambda b: ref(idx[b])
    try:
        yield
    finally:
        runner.batches, runner.calls = batches, calls
        del ctx._ref


def pick(xs: list, idx: list[int]) -> list:
    return [xs[i] for i in idx]


class HoldoutScorer(PlanScorer):
    """A :class:`PlanScorer` with recovery in the loop whose candidates are repaired on the
    ``fit`` batches and scored (raw and repaired) on the ``score`` batches."""

    def __init__(self, ctx, score: str, recovery, fraction: float):
        super().__init__(ctx, score, recovery)
        ctx.ensure_cached()
        self.fraction = fraction
        self.fit_batches, self.score_batches = holdout_split(len(ctx.runner.batches),
                                                             fraction)

    def describe(self) -> dict:
        return {"fraction": self.fraction, "fit_batches": self.fit_batches,
                "score_batches": self.score_batches}

    def _scored(self, start: int, h, plan: Plan) -> float:
        with only_batches(self.ctx, self.score_batches):
            return self.value(self.run_from(start, pick(h, self.score_batches), plan))

    def candidate(self, plan: Plan, units, states=None) -> Scored:
        if self.recovery is None:
            return super().candidate(plan, units, states)
        removed = plan.removed | frozenset(units)
        live = cuts_of(removed)
        cut = next(c for c in live if c[0] <= min(units) <= c[1])
        kept = {c: f for c, f in plan.fixes.items() if c in live and c != cut}
        base = Plan(removed, kept)
        k = cut_block(cut[0])
        h = self.ctx.boundary(0) if k < 0 else self.state(base, k, states)
        start = max(k, 0)
        raw = self._scored(start, h, base)
        ys = self.target(cut[1])
        with only_batches(self.ctx, self.fit_batches):
            fix = self.fit(cut, pick(h, self.fit_batches), base.removed,
                           pick(ys, self.fit_batches))
        if fix is not None:
            fixed = Plan(base.removed, {**kept, cut: fix})
            h2 = fix.apply(h) if isinstance(fix, EmbeddingFix) else h
            v = self._scored(start, h2, fixed)
            if v < raw:
                return Scored(v, fixed, raw)
        return Scored(raw, Plan(base.removed, {**kept, cut: None}), raw)
