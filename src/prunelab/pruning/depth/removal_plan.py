"""Removal plans scored from cached block boundaries: the engine of the ``sleb`` and ``beam``
depth searches, at block or sub-block granularity, with closed-form recovery in the loop.

**Units.** Block granularity removes whole blocks; sub-block granularity (BlockPruner, Zhong
et al. 2024, "BlockPruner: Fine-grained Pruning for Large Language Models") removes
attention and MLP branches separately. Both are written in units ``u = 2 b + p`` (``p = 0``
the attention, ``1`` the MLP of block ``b``); a block is gone when both its units are. A
removed branch is run as the branch zeroed, which is exactly what
:func:`prunelab.models.sublayer.remove_sublayers` leaves.

**Cuts.** A maximal run ``first..last`` of removed units is repaired at the output of the
block holding the last kept unit before it (``-1``: the embeddings); the target is the dense
state after ``last``: the cached boundary after its block when ``last`` is an MLP, else the
dense block run with its MLP zeroed (the stream after its attention).

**Recovery in the loop.** A candidate's own cut is fitted with the Depth config's recovery
on the calibration windows (the cut block's inputs from the plan's states, the targets from
the dense boundaries) on a copy of that one block, and the candidate is scored with and
without it. Least squares on hidden states minimises the error at the cut, not the KL or
NLL at the output, and can make those worse: the score is ``min(raw, repaired)`` and the
cut is marked repaired only when the repair helped (the applied model repairs only those
cuts). Fits of other cuts stay as they were fitted (they are refitted in order when the
chosen plan is applied), so a search score is an estimate of the applied model's.

Costs are counted by the probe context (one block over all calibration windows = 1).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from prunelab.errors import UnsupportedOperationError
from prunelab.models.sublayer import PARTS, branch_paths
from prunelab.pruning.depth.recoveries.linear_bridge import first_masks


def block_units(b: int) -> frozenset[int]:
    """The two units (attention, MLP) of block ``b``."""
    return frozenset((2 * b, 2 * b + 1))


def unit_name(u: int) -> tuple[int, str]:
    """``(block, "attention" | "mlp")`` of unit ``u``."""
    return u // 2, PARTS[u % 2]


def unit_of(block: int, part: str) -> int:
    return 2 * int(block) + PARTS.index(part)


def cuts_of(removed) -> list[tuple[int, int]]:
    """``(first, last)`` unit of each maximal run of removed units, in order."""
    runs: list[list[int]] = []
    for u in sorted(removed):
        if runs and u == runs[-1][1] + 1:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    return [(a, b) for a, b in runs]


def cut_block(first: int) -> int:
    """The block whose output is repaired for a run starting at unit ``first`` (-1:
    the embeddings)."""
    return (first - 1) // 2


def block_spans(cuts) -> list[tuple[int, int]]:
    """Whole-block cuts as half-open block spans (``(2, 5) -> (1, 3)``)."""
    return [(a // 2, b // 2 + 1) for a, b in cuts]


@dataclass
class BlockFix:
    """A repaired copy of the cut's block (a folded projection or an attached bridge)."""

    block: torch.nn.Module


@dataclass
class EmbeddingFix:
    """A bridge applied to the embeddings' output (a cut starting at block 0)."""

    bridge: torch.nn.Module
    token_aware: bool

    @torch.no_grad()
    def apply(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        masks = first_masks(xs) if self.token_aware else [None] * len(xs)
        return [self.bridge(x, m).detach() for x, m in zip(xs, masks, strict=True)]


@dataclass
class Plan:
    """Removed units and, per cut decided with recovery in the loop, its fix (``None``:
    left unrepaired because the repair did not help or the recovery cannot repair it)."""

    removed: frozenset = frozenset()
    fixes: dict = field(default_factory=dict)

    def repaired(self) -> list[tuple[int, int]]:
        return sorted(c for c, f in self.fixes.items() if f is not None)

    def parts(self) -> list[tuple[int, str]]:
        return [unit_name(u) for u in sorted(self.removed)]


@dataclass
class Scored:
    """A candidate plan, its score and its score without its own cut repaired."""

    value: float
    plan: Plan
    raw: float


class PlanScorer:
    """Runs removal plans on a probe context of the dense model and scores them by the
    calibration NLL (``"nll"``) or the all-positions KL to dense (``"kl"``).

    ``recovery``: the recovery fitted in the loop (``None``: score raw)."""

    def __init__(self, ctx, score: str = "kl", recovery=None):
        if score not in ("kl", "nll"):
            raise ValueError(f"score must be kl or nll, got {score!r}")
        self.ctx, self.score, self.recovery = ctx, score, recovery
        self.num_blocks = ctx.num_blocks
        self._mid: dict[int, list[torch.Tensor]] = {}

    # ---------------------------------------------------------------- running
    def _zero(self, module, b: int, parts) -> list:
        return [module.get_submodule(branch_paths(self.ctx.adapter, b, PARTS[p])[0])
                for p in parts]

    def run_block(self, b: int, h, removed, fixes: dict) -> list[torch.Tensor]:
        """Block ``b`` of the plan on ``h``: skipped, run with removed branches zeroed, or
        its repaired copy when a fix sits there."""
        gone = [p for p in (0, 1) if 2 * b + p in removed]
        if len(gone) == 2:
            return h
        fix = fixes.get(b)
        module = fix.block if fix is not None else self.ctx.adapter.block(b)
        with self.ctx.runner.zeroed(self._zero(module, b, gone)):
            return self.ctx.runner.run_block(b, h, block=module, args_from=b)

    @staticmethod
    def block_fixes(plan: Plan) -> dict:
        return {cut_block(c[0]): f for c, f in plan.fixes.items()
                if f is not None and cut_block(c[0]) >= 0}

    def run_from(self, start: int, h, plan: Plan, until: int | None = None):
        """The plan's stream entering block ``until`` (default: the raw last output),
        running blocks ``start..`` from ``h`` (the stream entering ``start``)."""
        fixes = self.block_fixes(plan)
        for b in range(start, self.num_blocks if until is None else until):
            h = self.run_block(b, h, plan.removed, fixes)
        return h

    def entry(self, plan: Plan):
        """The plan's stream entering block 0 (the embeddings, repaired when fixed)."""
        h = self.ctx.boundary(0)
        fix = next((f for c, f in plan.fixes.items() if cut_block(c[0]) < 0 and f), None)
        return fix.apply(h) if fix is not None else h

    def state(self, plan: Plan, b: int, states=None):
        """The plan's stream entering block ``b``: from ``states`` (a callable giving the
        current plan's states, valid up to ``b``) or run from the first changed block."""
        if states is not None:
            return states(b)
        changed = [u // 2 for u in plan.removed]
        changed += [cut_block(c[0]) for c, f in plan.fixes.items() if f is not None]
        first = min(changed, default=self.num_blocks)
        if first < 0:
            return self.run_from(0, self.entry(plan), plan, until=b)
        if b <= first:
            return self.ctx.boundary(b)
        return self.run_from(first, self.ctx.boundary(first), plan, until=b)

    def value(self, final) -> float:
        return self.ctx.nll(final) if self.score == "nll" else self.ctx.divergence(final)[1]

    # ---------------------------------------------------------------- recovery
    def target(self, last: int) -> list[torch.Tensor]:
        """The dense stream after unit ``last``."""
        j, p = divmod(last, 2)
        if p == 1:
            return self.ctx.boundary(j + 1)
        if j not in self._mid:
            blk = self.ctx.adapter.block(j)
            with self.ctx.runner.zeroed(self._zero(blk, j, [1])):
                self._mid[j] = self.ctx.runner.run_block(j, self.ctx.boundary(j))
        return self._mid[j]

    def fit(self, cut: tuple[int, int], inputs, removed, ys=None):
        """The recovery fitted at ``cut`` from the cut block's ``inputs`` (``None`` where
        the recovery cannot repair this cut); ``ys``: the targets (default: all windows)."""
        rec, ad = self.recovery, self.ctx.adapter
        k, ys = cut_block(cut[0]), self.target(cut[1]) if ys is None else ys
        if k < 0:
            if not rec.repairs_embeddings or not hasattr(rec, "make_bridge"):
                return None
            dtype = next(self.ctx.lm.model.parameters()).dtype
            return EmbeddingFix(rec.make_bridge(inputs, ys, ad.hidden_size(), dtype),
                                bool(getattr(rec, "token_aware", False)))
        try:
            rec.check(ad, k)
        except UnsupportedOperationError:
            return None
        gone = [p for p in (0, 1) if 2 * k + p in removed]
        if 1 in gone and not hasattr(rec, "make_bridge"):
            return None  # foldable / boundary need the block's MLP
        blocks, original = ad.blocks(), ad.block(k)
        twin = copy.deepcopy(original)
        blocks[k] = twin
        try:
            with self.ctx.runner.zeroed(self._zero(twin, k, gone)):
                rec.at_block(self.ctx.runner, k, inputs, ys)
        finally:
            blocks[k] = original
        return BlockFix(twin)

    # ---------------------------------------------------------------- candidates
    def candidate(self, plan: Plan, units, states=None) -> Scored:
        """Score ``plan`` with ``units`` removed too. ``states``: the current plan's
        streams entering each block (a callable), else the prefix is recomputed."""
        removed = plan.removed | frozenset(units)
        live = cuts_of(removed)
        cut = next(c for c in live if c[0] <= min(units) <= c[1])
        kept = {c: f for c, f in plan.fixes.items() if c in live and c != cut}
        base = Plan(removed, kept)
        if self.recovery is None:
            start = min(units) // 2
            v = self.value(self.run_from(start, self.state(base, start, states), base))
            return Scored(v, base, v)
        k = cut_block(cut[0])
        h = self.ctx.boundary(0) if k < 0 else self.state(base, k, states)
        start = max(k, 0)
        raw = self.value(self.run_from(start, h, base))
        fix = self.fit(cut, h, removed)
        if fix is not None:
            fixed = Plan(removed, {**kept, cut: fix})
            h2 = fix.apply(h) if isinstance(fix, EmbeddingFix) else h
            v = self.value(self.run_from(start, h2, fixed))
            if v < raw:
                return Scored(v, fixed, raw)
        return Scored(raw, Plan(removed, {**kept, cut: None}), raw)


class PlanStates:
    """The streams entering every block under the current plan of a greedy search: the
    dense boundaries before the first change, overridden from there on."""

    def __init__(self, scorer: PlanScorer):
        self.scorer = scorer
        self.over: dict[int, list[torch.Tensor]] = {}

    def __call__(self, b: int):
        return self.over[b] if b in self.over else self.scorer.ctx.boundary(b)

    def refresh(self, plan: Plan, start: int) -> None:
        """Recompute the streams entering blocks after ``start`` (``-1``: from the
        embeddings) for ``plan``."""
        sc = self.scorer
        if start < 0:
            self.over[0] = sc.entry(plan)
            start = 0
        h, fixes = self(start), sc.block_fixes(plan)
        for b in range(start, sc.num_blocks):
            h = sc.run_block(b, h, plan.removed, fixes)
            self.over[b + 1] = h
