"""PrunePath: gated FFNs as experts with a cumulative-mass router (pruning/moe)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.loading import wrap
from prunelab.pruning import METHODS
from prunelab.pruning.moe import (
    PrunePath,
    PrunePathMLP,
    prunepath_modules,
    reset_stats,
    routing_stats,
    set_mass,
)
from prunelab.pruning.moe.clustering import (
    balanced_assign,
    balanced_kmeans,
    balanced_sizes,
    coactivation_features,
    expert_permutation,
)
from prunelab.pruning.moe.convert import build_module, mlp_weights
from prunelab.pruning.moe.router import (
    centroid_router,
    centroids,
    expert_norms,
    fit_router,
    norm_shares,
    soft_cross_entropy,
)
from prunelab.registry import to_dict

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(2, 16, seed=5)


def _lm(arch: str = "llama"):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _calib(n: int = 8, t: int = 32) -> TokenBatches:
    return TokenBatches(input_ids=tiny_tokens(n, t, seed=1), spec="tiny", seqlen=t,
                        samples=n, seed=0, mode="calib", total_windows=n, sha256="0")


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _pruned(arch: str = "llama", **opts):
    lm = _lm(arch)
    ref = _logits(lm.model)
    opts = {"experts": 4, "router_steps": 40, **opts}
    rep = prunelab.prune(lm, PrunePath(**opts), _calib(), batch_size=4)
    return lm, ref, rep


# ---------------------------------------------------------------- clustering (pure maths)
def test_balanced_sizes_split_evenly():
    assert balanced_sizes(48, 4) == [12, 12, 12, 12]
    assert balanced_sizes(50, 4) == [13, 13, 12, 12]
    with pytest.raises(ValueError):
        balanced_sizes(3, 4)


def test_balanced_assign_respects_capacity_on_a_hand_case():
    # every channel prefers cluster 0, which has room for two: the two most similar
    # (channels 2 and 0) get it, the others go to cluster 1
    sim = torch.tensor([[0.8, 0.1], [0.7, 0.6], [0.9, 0.0], [0.5, 0.4]])
    assert balanced_assign(sim, [2, 2]).tolist() == [0, 1, 0, 1]
    # capacities of 3 and 1: channel 1 is the least similar to cluster 0 and moves
    sim = torch.tensor([[0.9, 0.0], [0.2, 0.1], [0.8, 0.3], [0.7, 0.6]])
    assert balanced_assign(sim, [3, 1]).tolist() == [0, 1, 0, 0]


def test_balanced_kmeans_gives_equal_clusters_and_recovers_planted_groups():
    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(4, 16, generator=g) * 5
    truth = torch.arange(48) % 4
    feats = dirs[truth] + 0.1 * torch.randn(48, 16, generator=g)
    labels = balanced_kmeans(feats, 4, seed=3)
    assert torch.bincount(labels, minlength=4).tolist() == [12, 12, 12, 12]
    groups = {frozenset((labels == e).nonzero().squeeze(1).tolist()) for e in range(4)}
    assert groups == {frozenset((truth == e).nonzero().squeeze(1).tolist()) for e in range(4)}
    assert torch.equal(balanced_kmeans(feats, 4, seed=3), labels)  # seeded
    uneven = balanced_kmeans(torch.randn(50, 8, generator=g), 4, seed=0)
    assert sorted(torch.bincount(uneven).tolist()) == [12, 12, 13, 13]


def test_coactivation_features_group_channels_active_on_the_same_tokens():
    # channels 0..5 fire on tokens 0..49, channels 6..11 on tokens 50..99
    acts = torch.zeros(100, 12)
    acts[:50, :6] = torch.rand(50, 6) + 0.5
    acts[50:, 6:] = -(torch.rand(50, 6) + 0.5)  # magnitudes count, not signs
    labels = balanced_kmeans(coactivation_features(acts), 2, seed=0)
    assert len(set(labels[:6].tolist())) == 1 and len(set(labels[6:].tolist())) == 1
    assert labels[0] != labels[6]


def test_expert_permutation_makes_each_cluster_contiguous():
    labels = torch.tensor([2, 0, 1, 0, 2, 1])
    perm, sizes = expert_permutation(labels, 3)
    assert perm.tolist() == [1, 3, 2, 5, 0, 4] and sizes == [2, 2, 2]


# ---------------------------------------------------------------- selection and module
def test_cumulative_mass_picks_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]])
    sel = PrunePathMLP.select
    assert sel(probs, 0.75).tolist() == [[True, True, False], [False, True, True],
                                         [True, False, True]]  # tie: the first index
    assert sel(probs, 0.45).tolist() == [[True, False, False], [False, True, False],
                                         [False, False, True]]
    assert sel(probs, 0.55).tolist() == [[True, True, False], [False, True, False],
                                         [True, False, True]]
    assert sel(probs, 1e-9).sum(-1).tolist() == [1, 1, 1]
    assert sel(probs, 1.0).all()


def _mlp_case(arch: str):
    lm = _lm(arch)
    w = mlp_weights(lm, 1)
    perm = torch.randperm(w["down"].shape[1], generator=torch.Generator().manual_seed(0))
    return lm, w, perm


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma"])
def test_permuted_experts_compute_the_dense_mlp(arch):
    lm, w, perm = _mlp_case(arch)
    mlp = lm.adapter.mlp(1)
    x = torch.randn(3, 7, lm.adapter.hidden_size())
    with torch.no_grad():
        want = mlp(x)
        act = {"llama": "silu", "phi3": "silu", "gemma": "gelu_tanh"}[arch]
        same = build_module(w, torch.arange(len(perm)), [12] * 4, act)
        assert torch.equal(same.dense(x), want)  # identity order: bit-identical
        mod = build_module(w, perm, [12] * 4, act)
        torch.testing.assert_close(mod.dense(x), want, rtol=0, atol=1e-6)
        h = x.reshape(-1, x.shape[-1])
        every = mod.routed(h, torch.ones(h.shape[0], 4, dtype=torch.bool))
        torch.testing.assert_close(every.reshape(x.shape), want, rtol=0, atol=1e-6)
        parts = sum(mod.expert(h, e) for e in range(4))
        torch.testing.assert_close(parts.reshape(x.shape), want, rtol=0, atol=1e-6)
        # one expert alone is its channels' share of the FFN
        only = mod.routed(h, torch.tensor([[False, True, False, False]]).expand(len(h), 4))
        torch.testing.assert_close(only, mod.expert(h, 1), rtol=0, atol=0)


def test_flops_count_the_actual_selection():
    mod = PrunePathMLP(8, [2, 2, 4], act="silu")
    assert mod.expert_flops() == [2 * 3 * 8 * 2, 2 * 3 * 8 * 2, 2 * 3 * 8 * 4]
    assert mod.flops_per_token() == 2 * 3 * 8 * 8 + 2 * (8 * 3 + 3)  # before any token
    mod.mass = 0.5
    h = torch.randn(4, 8)
    sel = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        mod.routed(h, sel)
    assert mod.stat_expert_tokens == [3, 2, 2] and mod.stat_tokens == 4
    want = (3 * 96 + 2 * 96 + 2 * 192 + 4 * 2 * (8 * 3 + 3)) / 4
    assert mod.flops_per_token() == round(want)
    mod.reset_stats()
    assert mod.stat_tokens == 0 and mod.stat_expert_tokens == [0, 0, 0]


# ---------------------------------------------------------------- routers
def test_norm_shares_and_expert_norms_split_the_ffn_output():
    lm, w, perm = _mlp_case("llama")
    mod = build_module(w, perm, [12] * 4, "silu")
    x = torch.randn(20, lm.adapter.hidden_size())
    norms = expert_norms(mod, x, chunk=7)
    assert norms.shape == (20, 4)
    torch.testing.assert_close(norms[:, 2], mod.expert(x, 2).detach().norm(dim=-1))
    shares = norm_shares(norms)
    torch.testing.assert_close(shares.sum(-1), torch.ones(20))
    assert norm_shares(torch.zeros(1, 4)).tolist() == [[0.25] * 4]


def test_centroids_are_the_mean_gate_rows_and_the_temperature_is_the_grid_best():
    gate = torch.arange(12.0).reshape(6, 2)
    assert centroids(gate, [2, 4]).tolist() == [[1.0, 2.0], [7.0, 8.0]]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 2, generator=g)
    cents = torch.randn(3, 2, generator=g)
    targets = torch.softmax(x @ cents.t() * 2.0, -1)
    weight, tau = centroid_router(cents, x, targets)
    torch.testing.assert_close(weight, cents * tau)
    best = soft_cross_entropy(x @ weight.t(), targets)
    for f in (0.8, 1.25):
        assert best <= soft_cross_entropy(x @ (cents * tau * f).t(), targets)


def test_fit_router_reaches_the_target_entropy_of_a_linear_softmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 6, generator=g) * torch.tensor([1, 2, 3, 0.5, 1, 4.0]) + 1.0
    w_true, b_true = torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    targets = torch.softmax(x @ w_true.t() + b_true, -1)
    entropy = float(-(targets * targets.log()).sum(-1).mean())
    start = float(soft_cross_entropy(torch.zeros(3000, 4), targets))
    w, b, ce = fit_router(x, targets, torch.zeros(4, 6), steps=400, lr=0.05, seed=0)
    assert ce == pytest.approx(float(soft_cross_entropy(x @ w.t() + b, targets)), rel=1e-5)
    assert ce - entropy < 0.02 * (start - entropy)
    w2, b2, _ = fit_router(x, targets, torch.zeros(4, 6), steps=400, lr=0.05, seed=0)
    assert torch.equal(w, w2) and torch.equal(b, b2)


# ---------------------------------------------------------------- the method on tiny models
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_mass_one_reproduces_the_dense_logits(arch):
    lm, ref, rep = _pruned(arch, mass=0.6)
    assert len(prunepath_modules(lm)) == lm.adapter.num_blocks
    assert 1 <= rep["calib_experts_per_token"] < 4
    assert rep["operation"] == "prune-moe" and rep["method"] == "prunepath"
    routed = _logits(lm.model)
    assert not torch.allclose(routed, ref, atol=1e-4)  # mass 0.6 skips experts
    set_mass(lm, 1.0)
    reset_stats(lm)
    torch.testing.assert_close(_logits(lm.model), ref, rtol=0, atol=2e-6)
    stats = routing_stats(lm)
    assert stats["experts_per_token"] == 4 and stats["ffn_flops_ratio"] == 1.0


@pytest.mark.parametrize("clustering,router", [("kmeans", "fitted"), ("coactivation", "centroid")])
def test_experts_per_token_decreases_with_mass(clustering, router):
    lm, _ref, rep = _pruned(clustering=clustering, router=router)
    for _, m in prunepath_modules(lm):
        assert m.sizes == [12, 12, 12, 12]
    used, ratios = [], []
    for p in (0.2, 0.4, 0.6, 0.8, 1.0):
        set_mass(lm, p)
        reset_stats(lm)
        _logits(lm.model, tiny_tokens(4, 24, seed=9))
        stats = routing_stats(lm)
        assert stats["tokens"] == 96
        used.append(stats["experts_per_token"])
        ratios.append(stats["ffn_flops_ratio"])
        for row, (_, m) in zip(stats["per_block"], prunepath_modules(lm), strict=True):
            # equal experts: router (when it ran) + experts used x one expert's cost
            router = m.router_flops() if p < 1 else 0
            want = row["experts_per_token"] * m.expert_flops()[0] + router
            assert row["ffn_flops_per_token"] == pytest.approx(want, abs=0.5)
    assert all(a <= b for a, b in zip(used, used[1:], strict=False))
    assert used[0] < used[-1] == 4
    below_one = ratios[:-1]  # the router costs FLOPs until mass 1 drops it
    assert all(a <= b for a, b in zip(below_one, below_one[1:], strict=False))
    assert ratios[0] < 0.75
    assert ratios[-1] == 1.0  # mass 1: the dense FFN, no router


def test_the_fitted_router_predicts_shares_better_than_the_centroid_one():
    _, _, fitted = _pruned(router="fitted", router_steps=200)
    _, _, centroid = _pruned(router="centroid")
    for f, c in zip(fitted["blocks"], centroid["blocks"], strict=True):
        assert f["target_entropy"] <= f["router_cross_entropy"] < c["router_cross_entropy"]


def test_checkpoint_reloads_with_identical_logits_and_mass_knobs(tmp_path):
    lm, _ref, _ = _pruned(mass=0.7)
    want = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["prunelab_moe_mass"] == 0.7
    assert {m["kind"] for m in cfg["prunelab_modules"]} == {"prunepath_mlp"}
    kw = {"trust_remote_code": True, "attn_implementation": "eager"}
    again = tf.AutoModelForCausalLM.from_pretrained(out, **kw).eval()
    torch.testing.assert_close(_logits(again), want, rtol=0, atol=0)
    # at load time
    half = tf.AutoModelForCausalLM.from_pretrained(out, prunelab_moe_mass=0.5, **kw).eval()
    assert [m.mass for _, m in prunepath_modules(half)] == [0.5] * 4
    set_mass(lm, 0.5)
    want_half = _logits(lm.model)
    torch.testing.assert_close(_logits(half), want_half, rtol=0, atol=0)
    # at runtime: set_mass, or one module's attribute
    set_mass(again, 0.5)
    torch.testing.assert_close(_logits(again), want_half, rtol=0, atol=0)
    prunepath_modules(again)[0][1].mass = 1.0
    assert not torch.equal(_logits(again), want_half)
    with pytest.raises(ValueError, match="mass must be in"):
        tf.AutoModelForCausalLM.from_pretrained(out, prunelab_moe_mass=1.5, **kw)
    # load -> save -> load keeps the experts and the mass
    back = prunelab.load(str(out), trust_remote_code=True)
    set_mass(back, 0.5)
    second = prunelab.save(back, tmp_path / "again")
    third = tf.AutoModelForCausalLM.from_pretrained(second, **kw).eval()
    torch.testing.assert_close(_logits(third), want_half, rtol=0, atol=0)


def test_config_round_trips_and_the_run_is_seeded():
    cfg = PrunePath(experts=8, clustering="coactivation", router="centroid", mass=0.5,
                    router_steps=10, seed=3)
    assert METHODS.from_dict(to_dict(cfg)) == cfg
    a, _, _ = _pruned(seed=2)
    b, _, _ = _pruned(seed=2)
    for (_, ma), (_, mb) in zip(prunepath_modules(a), prunepath_modules(b), strict=True):
        assert torch.equal(ma.router.weight, mb.router.weight)
        assert torch.equal(ma.gate_proj.weight, mb.gate_proj.weight)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("opts", [
    {"mass": math.nan}, {"mass": 0.0}, {"mass": 1.5}, {"mass": -0.1}, {"mass": math.inf},
    {"experts": 1}, {"experts": 2.5}, {"experts": True}, {"clustering": "spectral"},
    {"router": "mlp"}, {"router_steps": -1}, {"router_lr": 0.0}, {"router_lr": math.nan},
    {"seed": -1},
])
def test_bad_options_are_one_line_config_errors(opts):
    with pytest.raises(ConfigError) as err:
        PrunePath(**opts)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt"])
def test_ungated_families_are_refused_in_one_line(arch):
    lm = _lm(arch)
    with pytest.raises(UnsupportedOperationError, match="gated FFN") as err:
        prunelab.prune(lm, PrunePath(experts=4), _calib())
    assert "\n" not in str(err.value)


def test_more_experts_than_channels_twice_converted_and_bad_mass_are_refused():
    lm = _lm()
    with pytest.raises(ConfigError, match="more than block 0's 48 FFN channels"):
        prunelab.prune(lm, PrunePath(experts=64), _calib())
    with pytest.raises(UnsupportedOperationError, match="no PrunePath experts"):
        set_mass(lm, 0.5)
    prunelab.prune(lm, PrunePath(experts=4, router_steps=5), _calib())
    with pytest.raises(UnsupportedOperationError, match="already has PrunePath experts"):
        prunelab.prune(lm, PrunePath(experts=4), _calib())
    for bad in (math.nan, 0.0, 1.01):
        with pytest.raises(ConfigError):
            set_mass(lm, bad)
    with pytest.raises(ValueError):
        prunepath_modules(lm)[0][1].mass = math.nan
