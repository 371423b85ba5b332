"""Depth search: SLEB, sub-block granularity (BlockPruner), recovery in the loop, and the
costs in block evaluations; exact checks against brute force on tiny models."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch

from prunelab.errors import ConfigError
from prunelab.eval.divergence import token_nll
from prunelab.models.loading import wrap
from prunelab.models.sublayer import PARTS, remove_sublayers
from prunelab.probes import ProbeContext
from prunelab.probes.ablation import LeaveOneOut, SublayerAblation
from prunelab.pruning import RECOVERIES, Beam, Depth, depth_from_cli
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.recoveries import Recovery
from prunelab.pruning.depth.removal_plan import (
    Plan,
    PlanScorer,
    PlanStates,
    block_units,
    cuts_of,
    unit_of,
)
from prunelab.pruning.depth.search_budget import candidates
from prunelab.pruning.depth.strategies import Sleb
from prunelab.pruning.depth.surgery import run_depth

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)


def _lm(arch="llama", seed=0):
    return wrap(tiny_model(arch, seed=seed), char_tokenizer(), spec="tiny")


def _ctx(lm):
    return ProbeContext(lm, IDS, batch_size=2)


def _nll(model) -> float:
    with torch.no_grad():
        logits = model(input_ids=IDS, use_cache=False).logits
    return float(token_nll(logits, IDS).double().mean())


def _without_blocks(lm, blocks):
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec="tiny")
    work.adapter.delete_blocks(sorted(blocks))
    return work


# ---------------------------------------------------------------- sleb
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_sleb_one_step_equals_the_leave_one_out_argmin(arch):
    lm = _lm(arch)
    ctx = _ctx(lm)
    loo = LeaveOneOut().run(ctx).layer_values("value_all_positions")
    blocks, how = select(lm, Depth(remove=1, select=Sleb(score="kl")), ctx, 1)
    best = min(range(len(loo)), key=lambda i: loo[i])
    assert blocks == [best] and how["steps"][0]["score"] == loo[best]
    # protected ends: the argmin over the inner blocks
    blocks, _ = select(lm, Depth(remove=1, select=Sleb(score="kl", protect_ends=True)),
                       ctx, 1)
    assert blocks == [min((1, 2), key=lambda i: loo[i])]


def test_sleb_by_nll_equals_greedy_brute_force_over_pruned_models():
    """Each step's choice is the block whose deletion (for real, full forward) gives the
    lowest calibration NLL given the earlier choices: the refreshed streams are right."""
    lm = _lm("llama", seed=3)
    blocks, how = select(lm, Depth(remove=3, select=Sleb()), _ctx(lm), 3)
    chosen = []
    for step in how["steps"]:
        nll = {b: _nll(_without_blocks(lm, chosen + [b]).model)
               for b in range(4) if b not in chosen}
        best = min(nll, key=nll.get)
        assert step["removed"] == best
        assert step["score"] == pytest.approx(nll[best], rel=1e-5)
        chosen.append(best)
    assert blocks == sorted(chosen)


def test_sleb_cost_in_block_evaluations_is_exact():
    """One step over 4 blocks: candidate ``c`` reruns the ``3 - c`` blocks after it (6 in
    all, the leave-one-out probe's cost), then the chosen block's suffix is refreshed."""
    lm = _lm()
    ctx = _ctx(lm)
    blocks, how = select(lm, Depth(remove=1, select=Sleb()), ctx, 1)
    assert how["block_evaluations"] == 6 + (3 - blocks[0])
    assert how["cache_block_evaluations"] == 4


# ---------------------------------------------------------------- sub-blocks
def _plan_logits(scorer, units):
    plan = Plan(frozenset(units))
    final = scorer.run_from(0, scorer.ctx.boundary(0), plan)
    ad = scorer.ctx.adapter
    return torch.cat([ad.logits(ad.final_norm()(h)) for h in final])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_removing_both_branches_of_a_block_equals_removing_the_block(arch):
    lm = _lm(arch)
    scorer = PlanScorer(_ctx(lm))
    both = _plan_logits(scorer, {unit_of(1, "attention"), unit_of(1, "mlp")})
    whole = _plan_logits(scorer, block_units(1))
    deleted = _logits(_without_blocks(lm, [1]).model)
    torch.testing.assert_close(both, deleted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, both, rtol=0, atol=0)
    # and a partial plan equals the branches removed for real
    parts = [(0, "mlp"), (2, "attention"), (2, "mlp"), (3, "attention")]
    real = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec="tiny")
    rec = remove_sublayers(real, parts)
    assert rec["deleted_blocks"] == [2]
    torch.testing.assert_close(_plan_logits(scorer, {unit_of(*p) for p in parts}),
                               _logits(real.model), rtol=1e-5, atol=1e-5)


def _one_unit_budget(lm) -> float:
    """target_params that leaves a budget of one parameter: the search takes one step."""
    return float(sum(p.numel() for p in lm.model.parameters()) - 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sublayer_search_one_step_matches_brute_force(arch):
    lm = _lm(arch, seed=1)
    ctx = _ctx(lm)
    brute = {}
    for b in range(4):
        for part in PARTS:
            real = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec="tiny")
            remove_sublayers(real, [(b, part)])
            brute[(b, part)] = ctx.model_divergence(real)
    tp = _one_unit_budget(lm)
    best_all = min(brute, key=lambda k: brute[k][1])
    for strategy in (Sleb(score="kl"), Beam(seeds=8)):
        parts, how = select(lm, Depth(target_params=tp, select=strategy,
                                      granularity="sublayer"), ctx, 1)
        assert parts == [list(best_all)], strategy
    # one-shot by the sublayer-ablation probe ranks by the last-position KL
    parts, how = select(lm, Depth(target_params=tp, granularity="sublayer"), ctx, 1)
    assert parts == [list(min(brute, key=lambda k: brute[k][0]))]
    assert how["probe"] == "sublayer-ablation"


def test_sublayer_budget_counts_parameters_and_the_report_accounts_them():
    lm = _lm()
    params_before = sum(p.numel() for p in lm.model.parameters())
    rep = run_depth(lm, Depth(remove=1, select=Sleb(), granularity="sublayer"), IDS,
                    batch_size=2).to_dict()
    acc = rep["accounting"]
    block = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48 + 2 * 32  # q,o + k,v + mlp + norms
    removed = params_before - sum(p.numel() for p in lm.model.parameters())
    assert acc["params_removed"] == removed >= block
    # no sub-block could be left out and still reach one block's parameters
    assert min(r["params"] for r in acc["sublayers"]) > removed - block
    assert acc["flops_per_token_before"] - acc["flops_per_token_after"] == \
        acc["flops_per_token_removed"] == sum(r["flops_per_token"] for r in acc["sublayers"])
    assert rep["removed_sublayers"] == sorted(rep["removed_sublayers"])
    assert rep["needs_remote_code"] == bool(rep["partial_blocks"])


# ---------------------------------------------------------------- recovery in the loop
def _every_candidate(lm, recovery, granularity, steps=2):
    """(raw scorer score, in-loop score, in-loop raw) of every candidate of ``steps``
    greedy steps scored with recovery in the loop."""
    ctx = _ctx(lm)
    raw_scorer, scorer = PlanScorer(ctx, "kl"), PlanScorer(ctx, "kl", recovery)
    states, plan, rows = PlanStates(scorer), Plan(), []
    for step in range(steps):
        scored = []
        for units in candidates(4, plan.removed, granularity):
            s = scorer.candidate(plan, units, states)
            plain = raw_scorer.candidate(Plan(plan.removed), units).value if step == 0 \
                else None
            rows.append((plain, s.value, s.raw))
            scored.append((s.value, s, units))
        _, best, units = min(scored, key=lambda t: t[0])
        plan = best.plan
        cut = next(c for c in cuts_of(plan.removed) if c[0] <= min(units) <= c[1])
        states.refresh(plan, (cut[0] - 1) // 2)
    return rows


@pytest.mark.parametrize("recovery,granularity", [("ghost", "block"), ("foldable", "block"),
                                                  ("lra", "sublayer"),
                                                  ("foldable", "sublayer")])
def test_recovery_in_the_loop_never_scores_a_candidate_worse(recovery, granularity):
    rows = _every_candidate(_lm(), RECOVERIES.make(recovery), granularity)
    for plain, value, raw in rows:
        assert value <= raw
        if plain is not None:  # first step: raw is exactly the search without recovery
            assert raw == plain
    # the repair helps often (foldable cannot repair a cut after a block without its MLP)
    assert sum(value < raw for _, value, raw in rows) > len(rows) // 4


def test_in_loop_score_is_the_applied_models_kl():
    """One step: the candidate's cut is fitted on the same inputs and targets as the real
    repair, so the search's score is the applied model's calibration KL."""
    lm = _lm()
    rep = run_depth(lm, Depth(remove=1, select=Sleb(score="kl"), recovery="ghost",
                              recovery_in_loop=True, recovery_holdout=0), IDS,
                    batch_size=2).to_dict()
    step = rep["selection"]["steps"][0]
    assert step["score"] < step["score_without_recovery"]
    assert rep["calib_kl_after_recovery"] == pytest.approx(step["score"], rel=1e-4)
    assert rep["calib_kl_before_recovery"] == pytest.approx(step["score_without_recovery"],
                                                            rel=1e-4)


def test_a_repair_that_hurts_is_neither_scored_nor_applied():
    @RECOVERIES.register("flip-mlp")
    @dataclass(frozen=True)
    class FlipMlp(Recovery):
        """flips and scales the last kept block's MLP output (a repair that hurts)"""

        def at_block(self, runner, index, inputs, targets):
            down = runner.adapter.mlp_projections(index)["down"]
            with torch.no_grad():
                down.weight.mul_(-20.0)
            return {"error_before": 0.0, "error_after": 0.0}

    try:
        lm = _lm()
        raw, _ = select(lm, Depth(remove=2, select=Sleb(score="kl")), _ctx(lm), 2)
        rep = run_depth(lm, Depth(remove=2, select=Sleb(score="kl"), recovery="flip-mlp",
                                  recovery_in_loop=True, recovery_holdout=0), IDS,
                        batch_size=2).to_dict()
        sel = rep["selection"]
        assert rep["removed_blocks"] == raw and sel["repaired_cuts"] == []
        assert all(s["score"] == s["score_without_recovery"] for s in sel["steps"])
        assert rep["cuts"] == [] and \
            rep["calib_kl_after_recovery"] == rep["calib_kl_before_recovery"]
    finally:
        RECOVERIES.unregister("flip-mlp")


def test_beam_in_the_loop_and_sublayer_apply_repair_only_helpful_cuts():
    lm = _lm()
    rep = run_depth(lm, Depth(remove=1, select=Beam(seeds=4, width=2), recovery="ghost",
                              granularity="sublayer", recovery_in_loop=True,
                              recovery_holdout=0), IDS, batch_size=2).to_dict()
    sel = rep["selection"]
    assert sel["beam"]["best_cost"] == pytest.approx(rep["calib_kl_after_recovery"],
                                                     rel=0.05)
    repaired = [c for c in rep["cuts"] if "skipped" not in c]
    assert len(repaired) == len(sel["repaired_cuts"]) >= 1
    assert rep["calib_kl_after_recovery"] < rep["calib_kl_before_recovery"]


def test_iterative_in_the_loop_counts_its_probe_costs():
    for in_loop in (False, True):
        lm = _lm()
        cfg = Depth(remove=2, select="iterative", recovery="ghost", recovery_in_loop=in_loop)
        blocks, how = select(lm, cfg, ProbeContext(lm, IDS, batch_size=2, lazy=True), 2)
        # block influence: the dense cache (4 blocks), then the 3-block copy's cache
        assert len(blocks) == 2 and how["block_evaluations"] == 4 + 3


# ---------------------------------------------------------------- configuration
def test_search_options_are_validated_in_one_line():
    for kwargs, message in (
            ({"granularity": "heads"}, "granularity must be block or sublayer"),
            ({"granularity": "sublayer", "select": "no-adjacent"}, "one-shot, beam or sleb"),
            ({"granularity": "sublayer", "recovery": "boundary"}, "none, foldable, ghost"),
            ({"recovery_in_loop": True, "recovery": "ghost"}, "beam, sleb or iterative"),
            ({"recovery_in_loop": True, "select": "sleb"}, "needs a --recovery"),
            ({"select": Sleb, "blocks": (1,)}, "")):
        if "blocks" in kwargs:
            with pytest.raises(ConfigError):
                Depth(blocks=(1,), granularity="sublayer")
            continue
        with pytest.raises(ConfigError, match=message) as err:
            Depth(remove=1, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="nll or kl"):
        Sleb(score="ppl")
    cfg = depth_from_cli(remove=2, strategy="sleb", sleb_score="kl", protect_ends=True,
                         granularity="sublayer", recovery="ghost", recovery_in_loop=True)
    assert cfg == Depth(remove=2, select=Sleb(score="kl", protect_ends=True),
                        granularity="sublayer", recovery="ghost", recovery_in_loop=True)
    with pytest.raises(ConfigError, match="--sleb-score applies to --strategy sleb only"):
        depth_from_cli(remove=1, strategy="beam", sleb_score="kl")


def test_sublayer_one_shot_needs_a_sub_block_probe_result(tmp_path):
    lm = _lm()
    ctx = _ctx(lm)
    path = tmp_path / "loo.json"
    path.write_text(json.dumps(LeaveOneOut().run(ctx).to_dict()))
    with pytest.raises(ConfigError, match="sub-block probe"):
        select(lm, Depth(remove=1, granularity="sublayer", from_probe=str(path)), ctx, 1)
    path = tmp_path / "sub.json"
    path.write_text(json.dumps(SublayerAblation().run(ctx).to_dict()))
    parts, _ = select(lm, Depth(remove=1, granularity="sublayer", from_probe=str(path)),
                      ctx, 1)
    assert parts and all(p in PARTS for _, p in parts)


@pytest.mark.parametrize("arch,recovery", [("llama", "ghost"), ("gemma3_text", "none"),
                                           ("phi3", "lra")])
def test_sublayer_depth_checkpoints_reload_with_identical_logits(arch, recovery, tmp_path):
    import transformers as tf

    import prunelab
    from prunelab.data import TokenBatches
    from prunelab.pruning import METHODS

    calib = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0,
                         mode="calib", total_windows=4, sha256="0")
    cfg = Depth(remove=1, select=Sleb(score="kl"), granularity="sublayer", recovery=recovery)
    lm = _lm(arch)
    rep = prunelab.prune(lm, cfg, calib, batch_size=2)
    assert rep["needs_remote_code"]  # a block kept one branch, or a bridge was fitted
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(again), _logits(lm.model), rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert METHODS.from_dict(man["operations"][-1]["config"]) == cfg
    assert man["operations"][-1]["removed_sublayers"] == rep["removed_sublayers"]


# ---------------------------------------------------------------- explicit sub-blocks
@pytest.mark.parametrize("recovery", ["none", "ghost"])
def test_explicit_sublayers_reproduce_a_searched_plan(recovery):
    """A sub-block plan given back as ``sublayers`` (as the report lists it) gives the same
    model as the search that chose it (the recovery refitted on the same windows)."""
    searched = _lm()
    rep = run_depth(searched, Depth(remove=1, select=Sleb(), granularity="sublayer",
                                    recovery=recovery), IDS, batch_size=2).to_dict()
    given = _lm()
    cfg = Depth(sublayers=rep["removed_sublayers"], recovery=recovery)
    assert cfg.granularity == "sublayer"
    from prunelab.pruning import METHODS
    from prunelab.registry import to_dict
    assert METHODS.from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg  # manifest form
    again = run_depth(given, cfg, IDS, batch_size=2).to_dict()
    assert again["removed_sublayers"] == rep["removed_sublayers"]
    assert again["selection"]["strategy"] == "explicit"
    assert again["accounting"]["params_removed"] == rep["accounting"]["params_removed"]
    torch.testing.assert_close(_logits(given.model), _logits(searched.model), rtol=0, atol=0)


def test_explicit_sublayers_of_whole_blocks_equal_removing_the_blocks():
    by_parts = _lm()
    rep = run_depth(by_parts, Depth(sublayers="1:attention,1:mlp,2:attn,2:mlp"), IDS,
                    batch_size=2).to_dict()
    assert rep["removed_blocks"] == [1, 2] and not rep["partial_blocks"]
    assert not rep["needs_remote_code"]
    by_blocks = _without_blocks(_lm(), [1, 2])
    torch.testing.assert_close(_logits(by_parts.model), _logits(by_blocks.model),
                               rtol=0, atol=0)


def test_explicit_sublayers_are_validated_in_one_line():
    for kwargs, message in (
            ({"sublayers": "1:heads"}, "BLOCK:PART"),
            ({"sublayers": "x:mlp"}, "BLOCK:PART"),
            ({"sublayers": "1:mlp,1:mlp"}, "repeats"),
            ({"sublayers": "1:mlp", "remove": 1}, "exactly one of"),
            ({"sublayers": "1:mlp", "select": "sleb"}, "chosen explicitly"),
            ({"sublayers": "1:mlp", "recovery": "ghost", "recovery_in_loop": True},
             "chosen explicitly")):
        with pytest.raises(ConfigError, match=message) as err:
            Depth(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="invalid for 4 blocks"):
        run_depth(_lm(), Depth(sublayers="7:mlp"), IDS, batch_size=2)
    every = ",".join(f"{b}:{p}" for b in range(4) for p in ("attention", "mlp"))
    with pytest.raises(ConfigError, match="every branch of all 4 blocks"):
        run_depth(_lm(), Depth(sublayers=every), IDS, batch_size=2)
