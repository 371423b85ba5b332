"""Recovery in the loop without repeated work: the fast path of the greedy (SLEB) search.

The straightforward path (:class:`~prunelab.pruning.depth.holdout.HoldoutScorer` with
:class:`~prunelab.pruning.depth.removal_plan.PlanStates`) scores a candidate removal of
block ``c`` whose cut is repaired at block ``k`` (the last kept block before it) as:

1. raw: run blocks ``k..L-1`` of the plan from the stream entering ``k`` on the scoring
   batches, and take the NLL (or KL);
2. fit: run block ``k`` on the fit batches with a hook on its MLP branch (``foldable``) or
   plainly (bridges), solve the least squares, and run the repaired block once more for the
   fit statistics (``error_after``, which the search never reads);
3. repaired: run the repaired block ``k`` and the blocks after it on the scoring batches.

Here (same plans, same floats, fewer block evaluations):

* when block ``k`` runs unmodified in the current plan (no repair sits there), its output
  on every batch is the current plan's stored stream entering ``k + 1``, so the raw run
  starts at ``k + 1`` and a bridge (``ghost``, ``lra``, not token-aware) is applied to
  that stored stream instead of re-running block ``k`` (the bridge is a hook on the
  block's output: the same floats);
* ``foldable`` takes block ``k``'s MLP branch output from taps gathered while the current
  plan's streams are refreshed (:class:`TappedStates`: one tap per block and per change,
  instead of one per candidate and step), and ``T`` from
  :func:`~prunelab.pruning.depth.recovery.foldable_map` on those tensors (the same normal
  equations in the same order as :func:`~prunelab.pruning.depth.recovery.fit_foldable`);
* the fit statistics' extra block run is skipped;
* the NLL is the fused cross-entropy (the same per-token values as
  :func:`prunelab.eval.divergence.token_nll`'s log-softmax and gather, one pass less over
  the ``[B, T, V]`` logits).

Only the order of floating-point work that was already deterministic is shared, so the
scores equal the straightforward path's (tests compare both on tiny models). Sub-block
granularity, cuts at the embeddings and cuts whose block carries a repair in the current
plan take the straightforward path.
"""

from __future__ import annotations

import copy

import torch

from prunelab.errors import UnsupportedOperationError
from prunelab.models.bridges import attach_bridge
from prunelab.pruning.depth.holdout import HoldoutScorer, only_batches, pick
from prunelab.pruning.depth.recoveries.foldable import Foldable
from prunelab.pruning.depth.recoveries.linear_bridge import BridgeRecovery
from prunelab.pruning.depth.recovery import fold_map, foldable_map
from prunelab.pruning.depth.removal_plan import (
    BlockFix,
    Plan,
    PlanStates,
    Scored,
    cut_block,
    cuts_of,
)


@torch.no_grad()
def nll_fused(ctx, final_raw: list[torch.Tensor]) -> float:
    """Mean next-token NLL of raw last-block outputs ``final_raw`` (one ``[B, T, d]`` per
    calibration batch of ``ctx``), as :meth:`ProbeContext.nll` computes it, with the fused
    cross-entropy (per-token values summed in float64 per batch)."""
    norm = ctx.adapter.final_norm()
    total, count = 0.0, 0
    for b, h in enumerate(final_raw):
        h = h.to(ctx.runner.device)
        logits = ctx.adapter.logits(norm(h) if norm is not None else h)
        ids = ctx.runner.batches[b].to(logits.device)
        per = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
            reduction="none")
        total += float(per.double().sum())
        count += ids[:, 1:].numel()
    return total / count


class TappedStates(PlanStates):
    """:class:`PlanStates` that also keeps block ``b``'s MLP branch output on each batch,
    ``mlp(b, batches)``, for blocks the current plan runs unmodified: gathered by
    :meth:`refresh` while it runs the blocks anyway, or on first use (one tap of the block
    on the requested batches) for blocks no refresh has run since the search began.
    A tap stays valid until a refresh from an earlier block."""

    def __init__(self, scorer, tap: bool):
        super().__init__(scorer)
        self.tap = tap
        self.taps: dict[int, dict[int, torch.Tensor]] = {}  # block -> batch -> [B, T, d]

    def _module(self, b: int):
        return self.scorer.ctx.adapter.residual_branches(b)["mlp"]

    def refresh(self, plan: Plan, start: int) -> None:
        sc = self.scorer
        if start < 0:
            self.over[0] = sc.entry(plan)
            start = 0
        for b in [b for b in self.taps if b >= start]:
            del self.taps[b]
        h, fixes = self(start), sc.block_fixes(plan)
        runner = sc.ctx.runner
        for b in range(start, sc.num_blocks):
            plain = b not in fixes and not any(2 * b + p in plan.removed for p in (0, 1))
            if self.tap and plain:
                h, seen = runner.tap(b, h, {"m": self._module(b)})
                self.taps[b] = dict(enumerate(seen["m"]))
            else:
                h = sc.run_block(b, h, plan.removed, fixes)
            self.over[b + 1] = h

    def mlp(self, b: int, batches: list[int]) -> list[torch.Tensor]:
        """Block ``b``'s MLP branch output on ``batches`` (the block unmodified in the
        current plan, its input the current stream entering ``b``)."""
        have = self.taps.setdefault(b, {})
        need = [i for i in batches if i not in have]
        if need:
            ctx = self.scorer.ctx
            with only_batches(ctx, need):
                _, seen = ctx.runner.tap(b, pick(self(b), need), {"m": self._module(b)})
            have.update(zip(need, seen["m"], strict=True))
        return [have[i] for i in batches]


class FastScorer(HoldoutScorer):
    """A :class:`HoldoutScorer` (``fraction = 0``: fit and score on every batch, as
    :class:`PlanScorer` does) scoring candidates as the module docstring says."""

    def value(self, final) -> float:
        if self.score == "nll":
            return nll_fused(self.ctx, final)
        return super().value(final)

    def states(self) -> TappedStates:
        return TappedStates(self, tap=isinstance(self.recovery, Foldable))

    def _score_picked(self, start: int, hs, plan: Plan) -> float:
        """The plan's score from ``hs`` (the stream entering ``start`` on the scoring
        batches only)."""
        with only_batches(self.ctx, self.score_batches):
            return self.value(self.run_from(start, hs, plan))

    def candidate(self, plan: Plan, units, states=None) -> Scored:
        if self.recovery is None or not isinstance(states, TappedStates):
            return super().candidate(plan, units, states)
        removed = plan.removed | frozenset(units)
        live = cuts_of(removed)
        cut = next(c for c in live if c[0] <= min(units) <= c[1])
        k = cut_block(cut[0])
        fixed_here = any(cut_block(c[0]) == k and f is not None for c, f in plan.fixes.items())
        if k < 0 or fixed_here or any(2 * k + p in removed for p in (0, 1)):
            return super().candidate(plan, units, states)
        kept = {c: f for c, f in plan.fixes.items() if c in live and c != cut}
        base = Plan(removed, kept)
        fit_b, score_b = self.fit_batches, self.score_batches
        out = states(k + 1)  # block k's output: unmodified in the current plan
        raw = self._score_picked(k + 1, pick(out, score_b), base)
        ys = pick(self.target(cut[1]), fit_b)
        fix, after = self._fit(k, cut, states, out, ys, removed)
        if fix is not None:
            fixed = Plan(removed, {**kept, cut: fix})
            if after is not None:  # a bridge on block k's output: no need to run block k
                v = self._score_picked(k + 1, after, fixed)
            else:
                v = self._score_picked(k, pick(states(k), score_b), fixed)
            if v < raw:
                return Scored(v, fixed, raw)
        return Scored(raw, Plan(removed, {**kept, cut: None}), raw)

    def _fit(self, k: int, cut, states: TappedStates, out, ys, removed):
        """``(fix, after)``: the repair of ``cut`` at block ``k`` fitted on the fit
        batches, and for a plain bridge the repaired stream after block ``k`` on the
        scoring batches (``None``: run the repaired block)."""
        rec, ad, fit_b = self.recovery, self.ctx.adapter, self.fit_batches
        try:
            rec.check(ad, k)
        except UnsupportedOperationError:
            return None, None
        if isinstance(rec, Foldable):
            t, _ = foldable_map(pick(out, fit_b), states.mlp(k, fit_b), ys, rec.ridge)
            twin = copy.deepcopy(ad.block(k))
            blocks, original = ad.blocks(), ad.block(k)
            blocks[k] = twin  # the projections of the twin, found through the adapter
            try:
                fold_map(ad.mlp_projections(k)["down"], t)
            finally:
                blocks[k] = original
            return BlockFix(twin), None
        if isinstance(rec, BridgeRecovery):
            dtype = next(self.ctx.lm.model.parameters()).dtype
            bridge = rec.make_bridge(pick(out, fit_b), ys, ad.hidden_size(), dtype)
            twin = copy.deepcopy(ad.block(k))
            attach_bridge(twin, bridge)
            if rec.token_aware:  # the hook finds first positions from the call's arguments
                return BlockFix(twin), None
            with torch.no_grad():
                after = [bridge(x.to(dtype)).detach() for x in pick(out, self.score_batches)]
            return BlockFix(twin), after
        with only_batches(self.ctx, fit_b):
            return self.fit(cut, pick(states(k), fit_b), removed, ys), None
