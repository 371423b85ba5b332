"""Nested greedy depth searches (a run to n passes through the run to k < n) and held-out
scoring of recovery in the loop, on tiny models."""

from __future__ import annotations

import copy

import pytest
import torch

from prunelab.errors import ConfigError
from prunelab.eval.divergence import token_nll
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.pruning import RECOVERIES, Depth
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.holdout import holdout_split
from prunelab.pruning.depth.recoveries.ghost import Ghost
from prunelab.pruning.depth.removal_plan import Plan, PlanScorer, PlanStates, cut_block, cuts_of
from prunelab.pruning.depth.search_budget import candidates
from prunelab.pruning.depth.strategies import Sleb
from prunelab.pruning.depth.strategies.sleb import share_greedy_runs

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)


def _lm(seed=0):
    return wrap(tiny_model("llama", seed=seed), char_tokenizer(), spec="tiny")


def _strip(how: dict) -> dict:
    """``how`` without wall times and the nested marker (what must match exactly)."""
    out = {k: v for k, v in how.items() if k not in ("seconds", "nested")}
    out["steps"] = [{k: v for k, v in s.items() if k != "seconds"} for s in how["steps"]]
    return out


@pytest.mark.parametrize("kw", [
    {"select": Sleb(score="kl")},
    {"select": Sleb(), "recovery": "ghost", "recovery_in_loop": True,
     "recovery_holdout": 0.5},
    {"select": Sleb(score="kl"), "granularity": "sublayer"},
], ids=["block", "in-loop-holdout", "sublayer"])
def test_the_prefix_of_a_run_to_n_equals_a_run_to_k(kw):
    lm = _lm(seed=2)
    shared = ProbeContext(lm, IDS, batch_size=1)
    share_greedy_runs(shared)
    big, how_big = select(lm, Depth(remove=3, **kw), shared, 3)
    assert "nested" not in how_big
    for k in (2, 1):
        evals = shared.block_evaluations
        got, how = select(lm, Depth(remove=k, **kw), shared, k)
        assert shared.block_evaluations == evals  # answered from the run to 3
        assert how["nested"]["prefix_of_steps"] == len(how_big["steps"])
        alone, how_alone = select(lm, Depth(remove=k, **kw),
                                  ProbeContext(lm, IDS, batch_size=1), k)
        assert got == alone and _strip(how) == _strip(how_alone)
        assert how["seconds"] == how_big["steps"][len(how["steps"]) - 1]["seconds"]
    if kw.get("granularity") != "sublayer":
        assert set(alone) <= set(big)  # block removal sets are nested too


def test_a_budget_beyond_the_shared_run_searches_again():
    lm = _lm()
    ctx = ProbeContext(lm, IDS, batch_size=2)
    share_greedy_runs(ctx)
    select(lm, Depth(remove=1, select=Sleb()), ctx, 1)
    blocks, how = select(lm, Depth(remove=2, select=Sleb()), ctx, 2)
    assert "nested" not in how and len(how["steps"]) == 2
    # and the recovery is part of the key only with recovery in the loop
    _, how = select(lm, Depth(remove=1, select=Sleb(), recovery="ghost"), ctx, 1)
    assert how["nested"]["prefix_of_steps"] == 2
    _, how = select(lm, Depth(remove=1, select=Sleb(), recovery="ghost",
                              recovery_in_loop=True), ctx, 1)
    assert "nested" not in how


# ---------------------------------------------------------------- held-out scoring
def test_holdout_split_is_disjoint_and_spread():
    assert holdout_split(4, 0.25) == ([0, 1, 2], [3])
    assert holdout_split(8, 0.25) == ([0, 1, 2, 4, 5, 6], [3, 7])
    assert holdout_split(3, 0.9) == ([1], [0, 2])
    assert holdout_split(5, 0.0) == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    with pytest.raises(ConfigError, match="at least 2 calibration batches"):
        holdout_split(1, 0.25)


def test_holdout_zero_is_the_in_sample_search():
    """recovery_holdout=0 runs today's engine: a plain greedy loop over PlanScorer with the
    recovery fitted and scored on all windows."""
    lm = _lm(seed=1)
    ctx = ProbeContext(lm, IDS, batch_size=2)
    cfg = Depth(remove=2, select=Sleb(score="kl"), recovery="ghost", recovery_in_loop=True,
                recovery_holdout=0)
    blocks, how = select(lm, cfg, ctx, 2)
    scorer = PlanScorer(ctx, "kl", RECOVERIES.make("ghost"))
    states, plan, chosen = PlanStates(scorer), Plan(), []
    for step in how["steps"]:
        best = min(((scorer.candidate(plan, u, states), u) for u in
                    candidates(4, plan.removed, "block")), key=lambda t: t[0].value)
        plan = best[0].plan
        cut = next(c for c in cuts_of(plan.removed) if c[0] <= min(best[1]) <= c[1])
        states.refresh(plan, cut_block(cut[0]))
        assert step["removed"] == min(best[1]) // 2 and step["score"] == best[0].value
        chosen.append(step["removed"])
    assert blocks == sorted(chosen) and "holdout_split" not in how


def _window(ids: torch.Tensor) -> list[int]:
    return [next(i for i in range(len(IDS)) if torch.equal(IDS[i], row)) for row in ids]


def test_holdout_fits_and_scores_on_disjoint_windows(monkeypatch):
    """The straightforward path (its fits and scores are spied on here); the fast path
    gives the same scores (tests/pruning/depth/test_depth_fast_loop.py)."""
    from prunelab.pruning.depth.strategies import sleb

    monkeypatch.setattr(sleb, "FAST_IN_LOOP", False)
    lm = _lm(seed=1)
    ctx = ProbeContext(lm, IDS, batch_size=1)  # one window per batch
    fitted, scored = [], []
    original_fit, original_value = Ghost.at_block, PlanScorer.value

    def spy_fit(self, runner, index, inputs, targets):
        seen = _window(torch.cat(runner.batches))
        fitted.append(seen)
        for x, w in zip(inputs, seen, strict=True):  # the inputs are those windows' states
            assert torch.equal(x, ctx.boundary(index)[w]) or index > 0
        return original_fit(self, runner, index, inputs, targets)

    def spy_value(self, final):
        scored.append(_window(torch.cat(self.ctx.runner.batches)))
        return original_value(self, final)

    monkeypatch.setattr(Ghost, "at_block", spy_fit)
    monkeypatch.setattr(PlanScorer, "value", spy_value)
    cfg = Depth(remove=1, select=Sleb(), recovery="ghost", recovery_in_loop=True,
                recovery_holdout=0.25)
    blocks, how = select(lm, cfg, ctx, 1)
    assert how["holdout_split"] == {"fraction": 0.25, "fit_batches": [0, 1, 2],
                                    "score_batches": [3]}
    assert fitted and all(w == [0, 1, 2] for w in fitted)
    assert scored and all(w == [3] for w in scored)
    # the held-out score without repair is the pruned model's NLL on window 3 alone
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec="tiny")
    work.adapter.delete_blocks(blocks)
    with torch.no_grad():
        logits = work.model(input_ids=IDS[3:], use_cache=False).logits
    nll = float(token_nll(logits, IDS[3:]).double().mean())
    assert how["steps"][0]["score_without_recovery"] == pytest.approx(nll, rel=1e-5)
    assert how["steps"][0]["score"] <= how["steps"][0]["score_without_recovery"]


def test_holdout_option_is_validated():
    assert Depth(remove=1, select="sleb", recovery="ghost", recovery_in_loop=True).holdout \
        == 0.25
    assert Depth(remove=1, select="sleb", recovery="ghost").holdout == 0.0
    assert Depth(remove=1, select="iterative", recovery="ghost",
                 recovery_in_loop=True).holdout == 0.0
    for kw, msg in (({"select": "sleb", "recovery": "ghost", "recovery_holdout": 0.3},
                     "applies to --recovery-in-loop"),
                    ({"select": "iterative", "recovery": "ghost", "recovery_in_loop": True,
                      "recovery_holdout": 0.3}, "sleb or beam"),
                    ({"select": "sleb", "recovery": "ghost", "recovery_in_loop": True,
                      "recovery_holdout": 1.0}, r"\[0.0, 0.9\]")):
        with pytest.raises(ConfigError, match=msg):
            Depth(remove=1, **kw)
    lm = _lm()
    with pytest.raises(ConfigError, match="at least 2 calibration batches"):
        select(lm, Depth(remove=1, select="sleb", recovery="ghost", recovery_in_loop=True,
                         recovery_holdout=0.5), ProbeContext(lm, IDS, batch_size=4), 1)


# ---------------------------------------------------------------- sub-block search cost
def test_sublayer_steps_rerun_only_the_blocks_from_the_candidate_on():
    """Candidate ``(b, part)`` starts from the cached stream entering block ``b`` and reruns
    blocks ``b..3``: step 1 costs sum_b 2 (4 - b) = 20, then the refresh from the chosen
    block; in step 2 a partial block counts as one evaluation and a block that lost both
    branches as none. Cumulative counts per step are recorded."""
    from prunelab.pruning.depth.search_budget import unit_params

    lm = _lm(seed=2)
    ctx = ProbeContext(lm, IDS, batch_size=2)
    keep = sum(p.numel() for p in lm.model.parameters()) - max(unit_params(lm.adapter)) - 1
    parts, how = select(lm, Depth(target_params=float(keep), select=Sleb(score="kl"),
                                  granularity="sublayer"), ctx, 1)
    steps = how["steps"]
    assert len(steps) >= 2
    (b1, p1), = steps[0]["removed"]
    assert steps[0]["block_evaluations"] == 20 + (4 - b1)
    second = [(b, p) for b in range(4) for p in ("attention", "mlp") if (b, p) != (b1, p1)]
    cost = sum(4 - b - (b == b1) for b, _ in second)
    (b2, _), = steps[1]["removed"]
    assert steps[1]["block_evaluations"] - steps[0]["block_evaluations"] == \
        cost + (4 - b2 - (b2 == b1))


def test_beam_in_the_loop_scores_on_the_held_out_batches():
    from prunelab.pruning import Beam
    from prunelab.pruning.depth.holdout import HoldoutScorer
    from prunelab.pruning.depth.removal_plan import block_units

    lm = _lm(seed=1)
    ctx = ProbeContext(lm, IDS, batch_size=1)
    blocks, how = select(lm, Depth(remove=1, select=Beam(seeds=4, width=2), recovery="ghost",
                                   recovery_in_loop=True), ctx, 1)
    scorer = HoldoutScorer(ctx, "kl", RECOVERIES.make("ghost"), 0.25)
    best = min((scorer.candidate(Plan(), block_units(b)).value, b) for b in range(4))
    assert how["recovery_holdout"] == 0.25
    assert (how["beam"]["best_cost"], blocks) == (best[0], [best[1]])


# ---------------------------------------------------------------- resuming a search
@pytest.mark.parametrize("gran", ["block", "sublayer"])
def test_resuming_from_a_prefix_continues_the_run_exactly(gran):
    lm = _lm(seed=2)
    kw = {"select": Sleb(score="kl"), "granularity": gran}
    full, how_full = select(lm, Depth(remove=3, **kw), ProbeContext(lm, IDS, batch_size=1), 3)
    steps = how_full["steps"]
    k = 1 if gran == "block" else 2
    if gran == "block":
        start = ",".join(str(s["removed"]) for s in steps[:k])
    else:
        start = ",".join(f"{b}:{p}" for s in steps[:k] for b, p in s["removed"])
    ctx = ProbeContext(lm, IDS, batch_size=1)
    got, how = select(lm, Depth(remove=3, select=Sleb(score="kl", resume=start),
                                granularity=gran), ctx, 3)
    assert got == full
    assert [s["removed"] for s in how["steps"]] == [s["removed"] for s in steps[k:]]
    assert [s["score"] for s in how["steps"]] == [s["score"] for s in steps[k:]]
    assert how["resumed_from"]
    # it costs less than the whole run
    assert how["block_evaluations"] < how_full["block_evaluations"]


def test_resume_errors():
    lm = _lm()
    ctx = ProbeContext(lm, IDS, batch_size=1)
    nb = lm.adapter.num_blocks
    with pytest.raises(ConfigError, match="mixes"):
        Sleb(resume="1,2:mlp")
    with pytest.raises(ConfigError, match="BLOCK:PART"):
        Sleb(resume="1:foo")
    with pytest.raises(ConfigError, match="distinct"):
        Sleb(resume="1,1")
    with pytest.raises(ConfigError, match=f"the model has {nb}"):
        select(lm, Depth(remove=2, select=Sleb(resume=str(nb))), ctx, 2)
    with pytest.raises(ConfigError, match="granularity sublayer"):
        select(lm, Depth(remove=2, select=Sleb(resume="1:mlp")), ctx, 2)
    with pytest.raises(ConfigError, match="recovery-in-loop"):
        select(lm, Depth(remove=2, select=Sleb(resume="1"), recovery="ghost",
                         recovery_in_loop=True), ctx, 2)
    with pytest.raises(ConfigError, match="already reaches"):
        select(lm, Depth(remove=1, select=Sleb(resume="1")), ctx, 1)
    # whole blocks resume a sub-block search: both branches gone
    got, how = select(lm, Depth(remove=2, select=Sleb(score="kl", resume="1"),
                                granularity="sublayer"), ctx, 2)
    assert [1, "attention"] in got and [1, "mlp"] in got
    assert how["resumed_from"] == [[1, "attention"], [1, "mlp"]]
