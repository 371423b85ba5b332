"""``sleb`` (SLEB, Song et al. 2024, "SLEB: Streamlining LLMs through Redundancy
Verification and Elimination of Transformer Blocks"): remove one block at a time, each step
the block whose removal from the current model gives the lowest calibration NLL (SLEB's
metric; or the all-positions KL to dense with ``score="kl"``).

Each candidate starts from the current model's cached stream entering it and recomputes
only the blocks after it; after a removal is accepted the streams of the current model are
refreshed from the changed block on. At ``granularity="sublayer"`` the same greedy runs
over attention and MLP sub-blocks until the parameter budget is reached (BlockPruner,
Zhong et al. 2024); with ``recovery_in_loop`` each candidate is scored after its
closed-form recovery (see :mod:`prunelab.pruning.depth.removal_plan`), fitted on part of the
calibration batches and scored on the rest (``Depth.recovery_holdout``, see
:mod:`prunelab.pruning.depth.holdout`).

**Nested runs.** Greedy removal is nested: each step depends only on the plan so far (and,
with recovery in the loop, on the fixes and streams carried over from the earlier steps),
so the run to ``n`` passes through the run to every ``k < n``. Every step records its
cumulative block evaluations and seconds; :func:`share_greedy_runs` makes the searches on
one probe context answer a smaller budget with the prefix of a finished larger run
(selection, repaired cuts, costs as a run to ``k`` alone would have them) instead of
searching again (sweeps, benchmarks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from prunelab.errors import ConfigError
from prunelab.log import info, progress
from prunelab.pruning.depth.parallel import score_step
from prunelab.pruning.depth.removal_plan import (
    Plan,
    PlanStates,
    block_units,
    cut_block,
    cuts_of,
    unit_name,
    unit_of,
)
from prunelab.pruning.depth.search_budget import (
    candidates,
    search_result,
    search_setup,
)
from prunelab.pruning.depth.selection import parse_sublayers
from prunelab.pruning.depth.strategies.base import STRATEGIES, SelectJob, Strategy

SLEB_SCORES = ("nll", "kl")


@STRATEGIES.register("sleb")
@dataclass(frozen=True)
class Sleb(Strategy):
    """SLEB: greedy removal, each candidate scored by the calibration NLL (or KL)"""

    score: str = field(default="nll", metadata={"cli": "sleb_score",
                                                "help": "sleb: nll or kl"})
    protect_ends: bool = field(default=False, metadata={
        "help": "sleb: never remove the first or the last block"})
    resume: str = field(default="", metadata={
        "cli": "sleb_resume",
        "help": "sleb: continue a greedy search from these removed blocks (5,16) or "
                "sub-blocks (5:attention,16:mlp), e.g. the steps of an interrupted or "
                "smaller run; not with --recovery-in-loop"})

    workers: int = field(default=1, metadata={
        "cli": "sleb_workers",
        "help": "sleb: score each step's candidates in this many processes (Linux fork; "
                "the same choice and scores as one)"})

    uses_probe = False

    def __post_init__(self):
        if self.score not in SLEB_SCORES:
            raise ConfigError(f"sleb score must be nll or kl, got {self.score!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or \
                self.workers < 1:
            raise ConfigError(f"sleb workers must be an integer >= 1, got {self.workers!r}")
        parse_resume(self.resume)

    def choose(self, job: SelectJob) -> tuple[list, dict]:
        return greedy_search(job, self.score, self.protect_ends, self.resume,
                             workers=self.workers)


def parse_resume(text: str) -> tuple:
    """The entries of ``Sleb.resume``: block numbers (``"5,16"``) or ``(block, part)``
    pairs (``"5:attention,16:mlp"``), not mixed; a malformed entry is a ConfigError."""
    items = [p.strip() for p in str(text or "").split(",") if p.strip()]
    if not items:
        return ()
    if all(":" not in p for p in items):
        try:
            blocks = tuple(int(p) for p in items)
        except ValueError:
            raise ConfigError(f"--sleb-resume takes 0-based blocks (5,16) or sub-blocks "
                              f"(5:attention,16:mlp); got {text!r}") from None
        if min(blocks) < 0 or len(set(blocks)) != len(blocks):
            raise ConfigError(f"--sleb-resume: blocks must be distinct and >= 0: {text!r}")
        return blocks
    if any(":" not in p for p in items):
        raise ConfigError(f"--sleb-resume mixes blocks and sub-blocks: {text!r}")

    try:
        return parse_sublayers(items)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--sublayers", "--sleb-resume")) from None


def resume_plan(job: SelectJob, text: str):
    """The :class:`Plan` a resumed search starts from (``Plan()`` when ``text`` is
    empty), checked against the model and the search's granularity."""
    entries = parse_resume(text)
    if not entries:
        return Plan()
    if job.cfg.recovery_in_loop:
        raise ConfigError("--sleb-resume cannot resume a search with --recovery-in-loop "
                          "(its repairs were fitted along the way); run it whole")
    nb = job.ctx.num_blocks
    sub = isinstance(entries[0], tuple)
    if sub and job.cfg.granularity != "sublayer":
        raise ConfigError("--sleb-resume gives sub-blocks: use --granularity sublayer")
    if not sub and job.cfg.granularity == "sublayer":
        # whole blocks resume a sub-block search too: both their branches are gone
        entries = tuple((b, p) for b in entries for p in ("attention", "mlp"))
        sub = True
    blocks = [e[0] if sub else e for e in entries]
    if max(blocks) >= nb:
        raise ConfigError(f"--sleb-resume names block {max(blocks)}; the model has {nb}")
    units = frozenset(unit_of(b, p) for b, p in entries) if sub else \
        frozenset().union(*(block_units(b) for b in entries))
    return Plan(units)


#: greedy searches with recovery in the loop at block granularity take the fast path
#: (:mod:`prunelab.pruning.depth.fast_loop`: the same plans and scores, fewer block
#: evaluations); ``False`` runs the straightforward one (kept for comparison and tests)
FAST_IN_LOOP = True


def greedy_search(job: SelectJob, score: str, protect_ends: bool,
                  resume: str = "", fast: bool | None = None,
                  workers: int = 1) -> tuple[list, dict]:
    """SLEB's loop over blocks or sub-blocks (see module docstring); ``how`` records each
    step's choice, its score, its score without its own cut repaired and the cumulative
    block evaluations and seconds. With :func:`share_greedy_runs` on the context, a
    finished run reaching the budget answers it with its prefix. ``resume``: start from
    these removals (``Sleb.resume``; greedy removal is nested, so resuming from a run's
    prefix continues that run exactly; raw searches only). ``fast``: see
    :func:`search_setup`; ``workers``: processes scoring each step's candidates
    (:mod:`prunelab.pruning.depth.parallel`). Each step ends with a status line
    (``prunelab.log.info``)."""
    if score == "nll" and job.ctx.encoder:
        raise ConfigError("sleb score nll needs a causal LM; use --sleb-score kl "
                          "(1 - cos for encoders)")
    start = resume_plan(job, resume)
    memo = getattr(job.ctx, "greedy_runs", None)
    key = (*_run_key(job.cfg, score, protect_ends), tuple(sorted(start.removed)))
    scorer, budget, evals0 = search_setup(job, score, FAST_IN_LOOP if fast is None else fast)
    if start.removed and budget.done(start.removed):
        raise ConfigError("--sleb-resume already reaches the budget: nothing to search")
    if memo is not None and key in memo:
        hit = _prefix(memo[key], budget)
        if hit is not None:
            return hit
    states = scorer.states() if hasattr(scorer, "states") else PlanStates(scorer)
    plan, steps, snaps = start, [], []
    in_loop = scorer.recovery is not None
    t0 = time.perf_counter()
    if start.removed:
        states.refresh(plan, min(start.removed) // 2)
    while not budget.done(plan.removed):
        cands = candidates(job.ctx.num_blocks, plan.removed, job.cfg.granularity,
                           protect_ends)
        if not cands:
            raise ConfigError("sleb: no block left to remove within the budget")
        if workers > 1:
            s, _ = score_step(scorer, plan, cands, states, workers)
            units = s.plan.removed - plan.removed
        else:
            best = None
            for units in progress(cands, total=len(cands),
                                  desc=f"sleb step {len(steps) + 1}"):
                s = scorer.candidate(plan, units, states)
                if best is None or s.value < best[0].value:
                    best = (s, units)
            s, units = best
        plan = s.plan
        if in_loop:
            cut = next(c for c in cuts_of(plan.removed) if c[0] <= min(units) <= c[1])
            states.refresh(plan, cut_block(cut[0]))
        else:
            states.refresh(plan, min(units) // 2)
        what = [list(unit_name(u)) for u in sorted(units)] \
            if job.cfg.granularity == "sublayer" else min(units) // 2
        steps.append({"removed": what, "score": s.value, "score_without_recovery": s.raw,
                      "block_evaluations": job.ctx.block_evaluations - evals0,
                      "seconds": time.perf_counter() - t0})
        snaps.append(Plan(plan.removed, {c: (True if f is not None else None)
                                         for c, f in plan.fixes.items()}))
        info(step_line(steps, budget, score, in_loop))
    how = {"strategy": "sleb", "score": score, "protect_ends": protect_ends,
           **budget.describe(), "steps": steps}
    if workers > 1:
        how["workers"] = workers
    if start.removed:
        how["resumed_from"] = [list(unit_name(u)) for u in sorted(start.removed)] \
            if job.cfg.granularity == "sublayer" else sorted({u // 2 for u in start.removed})
    if hasattr(scorer, "describe") and scorer.fraction > 0:  # fast path: also at 0
        how["holdout_split"] = scorer.describe()
    chosen = search_result(job, plan, how, evals0)
    if memo is not None:
        memo[key] = GreedyRun(SimpleNamespace(cfg=job.cfg, ctx=job.ctx), how, snaps)
    return chosen


def step_line(steps: list, budget, score: str, in_loop: bool) -> str:
    """The status line of the last greedy step: what it removed, its score (and without
    its own repair), the cumulative block evaluations (of the search context) and time."""
    st = steps[-1]
    goal = f"/{budget.blocks}" if budget.blocks is not None else ""
    what = st["removed"] if isinstance(st["removed"], list) else f"block {st['removed']}"
    raw = f" (without its repair {st['score_without_recovery']:.4f})" if in_loop else ""
    return (f"sleb step {len(steps)}{goal}: removed {what}, {score} {st['score']:.4f}{raw}; "
            f"{st['block_evaluations']:.0f} block evaluations, {st['seconds']:.0f} s")


def share_greedy_runs(ctx) -> dict:
    """Let the ``sleb`` searches (block and sub-block) on probe context ``ctx`` share their
    runs: a search whose budget a finished run with the same options reaches is answered
    by that run's prefix (``how["nested"]`` says so). Returns the (new) store; run the
    largest budget first."""
    ctx.greedy_runs = {}
    return ctx.greedy_runs


def _run_key(cfg, score: str, protect_ends: bool) -> tuple:
    """What a greedy run depends on besides the context: the recovery and its holdout only
    when in the loop (the budget is not part of it: runs are nested)."""
    rec = (repr(cfg.recovery), cfg.holdout) if cfg.recovery_in_loop else None
    return (cfg.granularity, score, protect_ends, rec)


@dataclass
class GreedyRun:
    """A finished greedy run: its job (config and context only, not the model), its
    ``how`` and the plan after every step (fixes replaced by markers)."""

    job: SimpleNamespace
    how: dict
    plans: list


def _prefix(run: GreedyRun, budget) -> tuple[list, dict] | None:
    """The selection and ``how`` of the shortest prefix of ``run`` that reaches
    ``budget`` (``None``: the run stops short of it)."""
    k = next((i + 1 for i, p in enumerate(run.plans) if budget.done(p.removed)), None)
    if k is None:
        return None
    steps = run.how["steps"][:k]
    how = {key: v for key, v in run.how.items()
           if key not in ("steps", "repaired_cuts", "repair_spans", "blocks",
                          "params_to_remove", "block_evaluations")}
    how.update(budget.describe(), steps=steps)
    chosen, how = search_result(run.job, run.plans[k - 1], how, 0.0)
    how["block_evaluations"] = steps[-1]["block_evaluations"]
    how["seconds"] = steps[-1]["seconds"]
    how["nested"] = {"prefix_of_steps": len(run.plans), "steps": k}
    return chosen, how
