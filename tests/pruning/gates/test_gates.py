"""CausalGate static sublayer gates: the maths on hand-computed cases, the intervention KLs
against the sublayer-ablation probe, the budget cover, real removal through
``prunelab.prune``, checkpoints, the baselines and the user errors."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.custom import custom_modules
from prunelab.models.loading import wrap
from prunelab.probes.base import make_config
from prunelab.probes.context import ProbeContext
from prunelab.pruning import METHODS
from prunelab.pruning.gates.config import (
    Gates,
    Measurement,
    apply_plan,
    block_scores,
    latency_vs_dense,
    measure_sublayers,
    plan_blocks,
    plan_gates,
    plan_probe_greedy,
    sublayer_flops,
)
from prunelab.pruning.gates.fit import (
    bootstrap_rounds,
    cover_budget,
    ema_smooth,
    fit_gates,
    log_target,
    ranking_loss,
)

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16, seed=3)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")
PROBE_IDS = tiny_tokens(2, 12, seed=9)


def _lm(arch="llama"):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _logits(model):
    with torch.no_grad():
        return model(input_ids=PROBE_IDS, use_cache=False).logits


# ---------------------------------------------------------------------- maths
def test_ranking_loss_on_a_hand_computed_three_sublayer_case():
    importance = torch.tensor([0.3, 0.1, 0.2])  # ordered pairs: (0,1), (0,2), (2,1)
    gates = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    expect = (math.log1p(math.exp(-1.0)) + 2 * math.log1p(math.exp(-0.5))) / 3
    assert float(ranking_loss(gates, importance, tau=1.0)) == pytest.approx(expect, abs=1e-12)
    expect_tau = (math.log1p(math.exp(-2.0)) + 2 * math.log1p(math.exp(-1.0))) / 3
    assert float(ranking_loss(gates, importance, tau=0.5)) == pytest.approx(expect_tau,
                                                                            abs=1e-12)
    # a tie contributes no pair; no ordered pair at all: zero
    tied = torch.tensor([0.3, 0.3, 0.1])  # pairs (0,2): 1 - 0.5; (1,2): 0 - 0.5
    expect_tied = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(0.5))) / 2
    assert float(ranking_loss(gates, tied)) == pytest.approx(expect_tied, abs=1e-12)
    assert float(ranking_loss(gates, torch.ones(3))) == 0.0


def test_ema_and_bootstrap_rounds():
    rounds = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    torch.testing.assert_close(ema_smooth(rounds, 0.5), torch.tensor([3.5, 4.5],
                                                                     dtype=torch.float64))
    torch.testing.assert_close(ema_smooth(rounds, 0.0), rounds[-1].double())
    kl = torch.tensor([[1.0, 2.0, 6.0], [0.0, 3.0, 3.0]])
    torch.testing.assert_close(bootstrap_rounds(kl, 1), torch.tensor([[3.0, 2.0]],
                                                                     dtype=torch.float64))
    r = bootstrap_rounds(kl, 5, seed=4)
    assert r.shape == (5, 2)
    torch.testing.assert_close(r, bootstrap_rounds(kl, 5, seed=4))  # seeded
    # every round is the mean of 3 windows drawn from the 3: values on that grid
    sums = (r * 3).round()
    torch.testing.assert_close(r * 3, sums)


def test_fitted_gates_are_ordered_as_well_separated_kls():
    importance = torch.tensor([1e-4, 1e-1, 1e-3, 1.0, 1e-2, 3e-3])
    fit = fit_gates(importance, rank_weight=1.0, steps=400, lr=0.05)
    assert torch.argsort(fit.gates).tolist() == torch.argsort(importance).tolist()
    # the ranking term moved the gates beyond their regression targets' spread
    assert float(fit.gates.max() - fit.gates.min()) > float(fit.target.max() - fit.target.min())
    # without the ranking term the fit is the standardised log importance
    plain = fit_gates(importance, rank_weight=0.0, steps=2000, lr=0.05)
    torch.testing.assert_close(plain.gates, log_target(importance)[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(plain.scale.to_log_importance(plain.gates),
                               torch.log(importance.double() + plain.scale.eps),
                               atol=1e-3, rtol=0)


def test_cover_budget_is_greedy_then_minimal():
    # keys ascending: 2 (cost 1), 0 (cost 1), 1 (cost 5), 3 (cost 2); need 6
    # greedy takes 2, 0, 1 (total 7); dropping 1 fails, 0 (key 0.2) can go, 2 cannot then
    assert cover_budget([0.2, 0.5, 0.1, 0.9], [1, 5, 1, 2], 6) == [1, 2]
    assert cover_budget([0.2, 0.5, 0.1, 0.9], [1, 5, 1, 2], 0) == []
    assert cover_budget([0.2, 0.5], [3, 3], Fraction(3)) == [0]
    with pytest.raises(ValueError):
        cover_budget([0.1, 0.2], [1, 1], 3)


def _meas(kl_rows, flops, subs=None):
    subs = subs or [(i // 2, ("attention", "mlp")[i % 2]) for i in range(len(flops))]
    return Measurement(subs, torch.tensor(kl_rows, dtype=torch.float64), flops, "all")


def test_per_flop_selection_differs_from_plain_order_by_cost():
    # attention: KL 1.0 / 1.1 for 1 FLOP; MLP: KL 2.0 / 2.2 for 4 FLOPs (cheaper per FLOP)
    meas = _meas([[1.0], [2.0], [1.1], [2.2]], [1, 4, 1, 4])
    # per FLOP: mlp0 (0.5), mlp1 (0.55) reach 8 >= 5, both needed
    per_flop = plan_gates(meas, Gates(budget=0.5, rounds=1))
    assert per_flop.sublayers == [(0, "mlp"), (1, "mlp")] and per_flop.achieved == 0.8
    # plain order: attn0, attn1, mlp0 reach 6; attn1 is spare, attn0 is not
    order = plan_gates(meas, Gates(budget=0.5, rounds=1, select="order"))
    greedy = plan_probe_greedy(meas, 0.5)
    assert order.sublayers == greedy.sublayers == [(0, "attention"), (0, "mlp")]
    assert greedy.achieved == 0.5 and greedy.skipped_flops == 5 and greedy.total_flops == 10


# ---------------------------------------------------------------------- measurement
def test_intervention_kls_equal_the_sublayer_ablation_probe():
    lm = _lm("qwen2")
    ctx = ProbeContext(lm, IDS, batch_size=3)
    probe = make_config("sublayer-ablation").run(ctx)
    meas = measure_sublayers(lm, IDS, ctx=ctx, positions="all")
    last = measure_sublayers(lm, IDS, ctx=ctx, positions="last")
    ctx.close()
    by = {(s["layers"][0], s["sublayer"]): s for s in probe.scores}
    assert meas.kl.shape == (8, 4)
    for k, sub in enumerate(meas.sublayers):
        assert float(meas.mean_kl[k]) == pytest.approx(by[sub]["value_all_positions"],
                                                       rel=1e-5)
        assert float(last.mean_kl[k]) == pytest.approx(by[sub]["value"], rel=1e-9)


def test_sublayer_flops_with_and_without_attention_scores():
    ad = _lm().adapter  # hidden 32, 4 heads x 8, 2 KV heads, FFN 48
    subs = [(0, "attention"), (0, "mlp")]
    attn = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32)
    assert sublayer_flops(ad, subs) == [attn, 2 * 3 * 32 * 48]
    assert sublayer_flops(ad, subs, context=16) == [attn + 2 * 4 * 8 * 17, 2 * 3 * 32 * 48]


# ---------------------------------------------------------------------- the method
def test_budget_zero_is_refused():
    """A budget that skips nothing would write an unpruned "gates" checkpoint."""
    with pytest.raises(ConfigError, match=r"budget must be in \(0, 1\), got 0.0 \(0 skips no "
                       "sublayer\\)"):
        Gates(budget=0.0, steps=20)
    with pytest.raises(ConfigError, match="budget must be in"):
        Gates(budget=-0.0)


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.55])
def test_budget_is_met_and_no_removed_sublayer_is_spare(budget):
    lm = _lm("llama")
    rep = prunelab.prune(lm, Gates(budget=budget, steps=50), CALIB, batch_size=2)
    total, skipped = rep["sublayer_flops"], rep["skipped_flops"]
    assert rep["achieved"] >= budget and rep["achieved"] == skipped / total
    # the removed branches' FLOPs are exactly what the model lost
    assert rep["flops_per_token_before"] - rep["flops_per_token_after"] == skipped
    flops = {(g["layers"][0], g["sublayer"]): g["flops"] for g in rep["gates"]}
    for i, part in rep["removed_sublayers"]:
        assert (skipped - flops[(i, part)]) / total < budget  # each one was needed
    removed = {tuple(s) for s in rep["removed_sublayers"]}
    assert removed == {(g["layers"][0], g["sublayer"]) for g in rep["gates"] if g["removed"]}


def test_removal_equals_zeroing_the_gated_branches():
    lm, ref_lm = _lm("qwen3"), _lm("qwen3")
    rep = prunelab.prune(lm, Gates(budget=0.3, steps=50), CALIB, batch_size=2)
    handles = []
    for i, part in rep["removed_sublayers"]:
        branch = ref_lm.adapter.residual_branches(i)[part]
        handles.append(branch.register_forward_hook(
            lambda m, a, out: (torch.zeros_like(out[0]), *out[1:])
            if isinstance(out, tuple) else torch.zeros_like(out)))
    ref = _logits(ref_lm.model)
    for h in handles:
        h.remove()
    torch.testing.assert_close(_logits(lm.model), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_checkpoint_reloads_with_identical_logits(arch, tmp_path):
    lm = _lm(arch)
    rep = prunelab.prune(lm, Gates(budget=0.3, steps=50), CALIB, batch_size=2)
    assert rep["removed_sublayers"]
    ref = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=0)
    op = json.loads((out / "manifest.json").read_text())["operations"][-1]
    assert METHODS.from_dict(op["config"]) == Gates(budget=0.3, steps=50)
    assert op["achieved"] == rep["achieved"]


def test_baselines_reach_the_same_budget():
    lm = _lm("llama")
    ctx = ProbeContext(lm, IDS, batch_size=2)
    meas = measure_sublayers(lm, IDS, ctx=ctx)
    scores = block_scores(ctx)
    ctx.close()
    greedy = plan_probe_greedy(meas, 0.3)
    ranked = sorted(range(8), key=lambda s: float(meas.mean_kl[s]))
    need, prefix, total = 0.3 * sum(meas.flops), [], 0
    for s in ranked:  # the shortest prefix of the KL ranking that reaches the budget
        if total >= need:
            break
        prefix.append(meas.sublayers[s])
        total += meas.flops[s]
    assert set(greedy.sublayers) <= set(prefix) and prefix[-1] in greedy.sublayers
    blocks = plan_blocks(meas, scores, 0.3)
    assert blocks.achieved >= 0.3 and greedy.achieved >= 0.3
    k = len(blocks.details["blocks"])
    assert blocks.details["blocks"] == sorted(sorted(range(4), key=lambda b: scores[b])[:k])
    assert blocks.skipped_flops == sum(meas.flops[:2]) * k  # every block costs the same
    assert (k - 1) * sum(meas.flops[:2]) < need
    rec = apply_plan(lm, blocks)
    assert rec["deleted_blocks"] == blocks.details["blocks"]
    assert custom_modules(lm.model) == []  # whole blocks only: a plain checkpoint


def test_latency_report_is_consistent():
    lm = _lm("llama")
    gated = _lm("llama")
    prunelab.prune(gated, Gates(budget=0.5, steps=20), CALIB, batch_size=2)
    lat = latency_vs_dense(lm, gated, prompt_len=16, rounds=1, repeats=1)
    assert lat["prefill_seconds"] == pytest.approx(16 / lat["prefill_tokens_per_s"])
    assert lat["prefill_speedup"] == pytest.approx(
        lat["prefill_tokens_per_s"] / lat["dense_prefill_tokens_per_s"])


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("opts", [
    {"budget": float("nan")}, {"budget": 1.0}, {"budget": -0.1}, {"budget": float("inf")},
    {"ema": 1.0}, {"ema": float("nan")}, {"rank_weight": -1.0}, {"tau": 0.0},
    {"steps": -1}, {"steps": 1.5}, {"lr": 0.0}, {"lr": float("nan")}, {"rounds": 0},
    {"seed": -1}, {"select": "best"}, {"positions": "first"}, {"attention_scores": "yes"},
])
def test_bad_options_are_one_line_config_errors(opts):
    with pytest.raises(ConfigError) as err:
        Gates(**opts)
    assert "\n" not in str(err.value) and next(iter(opts)) in str(err.value)


def test_config_round_trips_and_unreachable_budget_is_refused():
    cfg = Gates(budget=0.25, ema=0.5, rounds=3, select="order", attention_scores=True)
    assert METHODS.from_dict(prunelab.registry.to_dict(cfg)) == cfg
    lm = _lm("llama")
    with pytest.raises(ConfigError, match="every block"):
        prunelab.prune(lm, Gates(budget=0.99, steps=5), CALIB, batch_size=2)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt"])
def test_unsupported_families_fail_before_calibration(arch):
    lm = _lm(arch)
    with pytest.raises(UnsupportedOperationError) as err:
        prunelab.prune(lm, Gates(), "text:/nonexistent/file.txt")
    assert "\n" not in str(err.value) and "pre-norm decoder" in str(err.value)


def test_a_budget_reached_exactly_needs_no_extra_block():
    # 10 equal blocks: 10 % is exactly one block (0.1 read as 1/10, not the float above it)
    meas = _meas([[float(k)] for k in range(20)], [1] * 20,
                 [(i // 2, ("attention", "mlp")[i % 2]) for i in range(20)])
    plan = plan_blocks(meas, list(range(10)), 0.1)
    assert plan.details["blocks"] == [0] and plan.achieved == 0.1
    assert plan_probe_greedy(meas, 0.3).sublayers == [(0, "attention"), (0, "mlp"),
                                                       (1, "attention"), (1, "mlp"),
                                                       (2, "attention"), (2, "mlp")]
