"""Cross-layer shared dictionaries (Basis Sharing and the optimized shared dictionary):
exactness at full rank, the alternating objective, the pairing, storage counted once,
checkpoints and budgets."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.custom import custom_modules, flops_per_token
from prunelab.models.linear import in_out_features
from prunelab.models.loading import wrap
from prunelab.models.size import model_size
from prunelab.pruning.base import METHODS
from prunelab.pruning.factor import shared as sh
from prunelab.pruning.factor import shared_math as sm
from prunelab.pruning.factor.config import FactorPruner
from prunelab.pruning.factor.shared import BasisSharing, SharedDict
from prunelab.pruning.factor.shared_modules import SharedBasisLinear, SharedDictionary

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

CALIB = tiny_tokens(4, 16, seed=1)
IDS = tiny_tokens(2, 10, seed=3)
ARCHS = ["llama", "qwen3", "gpt2", "phi3"]


def _lm(arch):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _logits(lm, ids=IDS):
    with torch.no_grad():
        return lm.model(input_ids=ids, use_cache=False).logits


def _run(lm, cfg):
    cfg.precheck(lm)
    return FactorPruner().run(lm, cfg, CALIB, batch_size=2).values


def _problem(n_layers=3, out=6, d_in=8, tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(out, d_in, generator=g, dtype=torch.float64) for _ in range(n_layers)]
    hs = []
    for _ in range(n_layers):
        x = torch.randn(tokens, d_in, generator=g, dtype=torch.float64) \
            * torch.linspace(0.2, 3, d_in, dtype=torch.float64)
        hs.append(sm.damped(x.t() @ x, 1e-3))
    return ws, hs


def test_methods_are_registered():
    assert METHODS.get("basis-sharing") is BasisSharing
    assert METHODS.get("shared-dict") is SharedDict
    from prunelab.registry import to_dict

    for cfg in (SharedDict(expand=1.5, pairing="adjacent"), BasisSharing(group=3, rank=5)):
        assert METHODS.from_dict(to_dict(cfg)) == cfg


# ------------------------------------------------------------------ maths
def test_basis_sharing_matches_the_whitened_svd_by_hand():
    ws, hs = _problem(2)
    d, cs = sm.basis_sharing(ws, hs, 3)
    s = torch.linalg.cholesky(hs[0] + hs[1])
    m = torch.cat([w.t() for w in ws], 1)
    u, sig, vh = torch.linalg.svd(s.t() @ m, full_matrices=False)
    best = s.t().inverse() @ u[:, :3] @ torch.diag(sig[:3]) @ vh[:3]  # M ~ D^T C^T
    torch.testing.assert_close(torch.cat([(c @ d).t() for c in cs], 1), best)
    # truncation loss in the summed-Gram metric = dropped singular values squared
    err = sum(float(((w - c @ d) @ (hs[0] + hs[1]) * (w - c @ d)).sum())
              for w, c in zip(ws, cs, strict=True))
    assert err == pytest.approx(float((sig[3:] ** 2).sum()), rel=1e-9)


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_each_step_solves_its_normal_equations(n_layers):
    ws, hs = _problem(n_layers)
    d, cs = sm.basis_sharing(ws, hs, 4)
    new_cs = [sm.coefficient_step(w, h, d) for w, h in zip(ws, hs, strict=True)]
    for w, h, c in zip(ws, hs, new_cs, strict=True):  # d/dC tr((W - C D) H (W - C D)^T) = 0
        torch.testing.assert_close((w - c @ d) @ h @ d.t(), torch.zeros(6, 4, dtype=d.dtype),
                                   atol=1e-9, rtol=0)
    new_d = sm.dictionary_step(ws, hs, new_cs, d)
    grad = sum(c.t() @ (w - c @ new_d) @ h for w, h, c in zip(ws, hs, new_cs, strict=True))
    assert float(grad.abs().max()) < 1e-7
    # against the vectorised (Kronecker) solve of sum_l A_l D H_l = B
    a = sum(torch.kron(c.t() @ c, h) for c, h in zip(new_cs, hs, strict=True))  # row-major vec(D)
    b = sum(c.t() @ w @ h for c, w, h in zip(new_cs, ws, hs, strict=True))
    torch.testing.assert_close(new_d, torch.linalg.solve(a, b.reshape(-1)).reshape(4, 8),
                               atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("n_layers", [2, 3])
def test_alternating_objective_never_increases_and_beats_basis_sharing(n_layers):
    ws, hs = _problem(n_layers, seed=4)
    d, cs = sm.basis_sharing(ws, hs, 3)
    start = sm.objective(ws, hs, d, cs)
    d2, cs2, hist = sm.alternate(ws, hs, d, cs, iters=15)
    assert hist[0] == start
    assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))
    assert hist[-1] < 0.99 * start  # each layer's own Gram: strictly better here
    assert sm.objective(ws, hs, d2, cs2) == pytest.approx(hist[-1], rel=1e-12)
    # every half step is a minimiser, so unguarded steps decrease too
    c_only = [sm.coefficient_step(w, h, d) for w, h in zip(ws, hs, strict=True)]
    mid = sm.objective(ws, hs, d, c_only)
    assert mid <= start
    assert sm.objective(ws, hs, sm.dictionary_step(ws, hs, c_only, d), c_only) <= mid * (1 + 1e-12)


def _brute_force(cost, single):
    n = len(cost)
    best = math.inf

    def rec(left, acc):
        nonlocal best
        if not left:
            best = min(best, acc)
            return
        a, rest = left[0], left[1:]
        if len(left) % 2 == 1:  # one layer may stay alone
            rec(rest, acc + single[a])
        for j, b in enumerate(rest):
            rec(rest[:j] + rest[j + 1:], acc + cost[a][b])

    rec(list(range(n)), 0.0)
    return best


def test_matching_is_exact_on_a_hand_made_cost_matrix():
    # greedy takes (0, 1) = 1 and is left with (2, 3) = 100; the optimum is 2 + 2
    cost = [[0, 1, 2, 50], [1, 0, 50, 2], [2, 50, 0, 100], [50, 2, 100, 0]]
    assert sm.min_weight_pairing(cost) == [(0, 2), (1, 3)]
    assert sm.pairing_cost(cost, sm.min_weight_pairing(cost)) == 4
    assert sm._greedy(cost, 4) == [(0, 1), (2, 3)]
    assert sorted(sm._two_opt(cost, [(0, 1), (2, 3)])) == [(0, 2), (1, 3)]


@pytest.mark.parametrize("n", [4, 5, 6, 7])
def test_matching_equals_brute_force_and_odd_layers_stay_alone_once(n):
    g = torch.Generator().manual_seed(n)
    c = torch.rand(n, n, generator=g, dtype=torch.float64)
    cost = ((c + c.t()) / 2).tolist()
    single = torch.rand(n, generator=g, dtype=torch.float64).tolist()
    pairs = sm.min_weight_pairing(cost, single)
    assert sorted(i for p in pairs for i in p) == list(range(n))
    assert sum(len(p) == 1 for p in pairs) == n % 2
    assert sm.pairing_cost(cost, pairs, single) == pytest.approx(_brute_force(cost, single))


def test_heuristic_matching_for_many_layers_is_never_worse_than_adjacent(monkeypatch):
    monkeypatch.setattr(sm, "EXACT_MAX", 2)
    g = torch.Generator().manual_seed(0)
    for n in (8, 9, 12):
        c = torch.rand(n, n, generator=g, dtype=torch.float64)
        cost = ((c + c.t()) / 2).tolist()
        single = [0.5] * n
        pairs = sm.min_weight_pairing(cost, single)
        assert sorted(i for p in pairs for i in p) == list(range(n))
        got = sm.pairing_cost(cost, pairs, single)
        assert got <= sm.pairing_cost(cost, sm.adjacent_pairs(n), single)
        if n % 2 == 0:  # greedy then 2-opt: never above greedy
            assert got <= sm.pairing_cost(cost, sm._greedy(cost, n)) + 1e-12


# ------------------------------------------------------------------ on models
def _targets(lm, roles):
    ad = lm.adapter
    paths = {**ad.spec.attn_proj, **ad.spec.mlp_proj}
    return [ad.linears(i)[paths[r]] for r in roles if r in paths
            for i in range(ad.num_blocks)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group", [1, 2])
def test_full_rank_reproduces_weights_and_logits(arch, group):
    from prunelab.models.linear import weight_out_in

    lm = _lm(arch)
    ref = _logits(lm)
    names = {id(m): n for n, m in lm.model.named_modules()}
    dense = {names[id(m)]: weight_out_in(m).detach().clone()
             for m in _targets(lm, sh.DEFAULT_TYPES.split(","))}
    d_in = lm.model.config.hidden_size
    values = _run(lm, BasisSharing(group=group, rank=d_in))
    assert values["needs_remote_code"] is True
    torch.testing.assert_close(_logits(lm), ref, atol=1e-5, rtol=1e-5)
    for path, w in dense.items():
        mod = lm.model.get_submodule(path)
        assert isinstance(mod, SharedBasisLinear)
        assert mod.rank == min(d_in, group * mod.out_features)  # capped at full rank
        torch.testing.assert_close(mod.dense_weight(), w, atol=1e-5, rtol=1e-5)
    assert sum(len(g) for gs in values["groups"].values() for g in gs) == len(dense)


def test_full_rank_shared_dict_reproduces_logits():
    lm = _lm("llama")
    ref = _logits(lm)
    _run(lm, SharedDict(rank=lm.model.config.hidden_size, iters=3))
    torch.testing.assert_close(_logits(lm), ref, atol=1e-5, rtol=1e-5)


def _expected_sizes(lm, values):
    """Stored parameters and FLOPs per token computed by hand from the groups and ranks."""
    ad = lm.adapter
    paths = {**ad.spec.attn_proj, **ad.spec.mlp_proj}
    params = flops = 0
    for role, groups in values["groups"].items():
        k = values["ranks"][role]
        for g in groups:
            d_in, _ = in_out_features(ad.linears(g[0])[paths[role]])
            outs = [in_out_features(ad.linears(i)[paths[role]])[1] for i in g]
            params += k * d_in + k * sum(outs)  # D once, every C_l
            flops += sum(2 * (k * d_in + o * k) for o in outs)  # D x once per layer
    return params, flops


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dictionary_stored_and_counted_once(arch):
    lm = _lm(arch)
    targets = _targets(lm, sh.DEFAULT_TYPES.split(","))
    dense_w = sum(in_out_features(m)[0] * in_out_features(m)[1] for m in targets)
    before = model_size(lm.model)["params"]
    flops_before = flops_per_token(lm.model)
    values = _run(lm, SharedDict(ratio=0.4, iters=2))
    stored, flops = _expected_sizes(lm, values)
    assert values["params_after"] == model_size(lm.model)["params"] == before - dense_w + stored
    dense_flops = sum(2 * in_out_features(m)[0] * in_out_features(m)[1] for m in targets)
    assert values["flops_per_token_after"] == flops_per_token(lm.model) \
        == flops_before - dense_flops + flops
    dicts = [m for _, m in custom_modules(lm.model) if isinstance(m, SharedDictionary)]
    keys = [k for k in lm.model.state_dict() if "prunelab_dictionaries" in k]
    assert len(keys) == len(dicts) == sum(len(g) for g in values["groups"].values())
    basis = [m for _, m in custom_modules(lm.model) if isinstance(m, SharedBasisLinear)]
    assert len(basis) == len(targets)
    for m in basis:  # the layer holds its coefficients (+ bias) only
        assert sum(p.numel() for p in m.parameters()) == m.coefficients.weight.numel() + (
            0 if m.coefficients.bias is None else m.coefficients.bias.numel())
        assert m.shared() is lm.model.get_submodule(m.dictionary)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_reload_gives_identical_logits(arch, tmp_path):
    lm = _lm(arch)
    values = _run(lm, SharedDict(ratio=0.3, iters=3))
    ref = _logits(lm)
    out = prunelab.save(lm, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    kinds = [m["kind"] for m in cfg["prunelab_modules"]]
    assert kinds.count("shared_dictionary") == sum(len(g) for g in values["groups"].values())
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    with torch.no_grad():
        got = again(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert model_size(again)["params"] == values["params_after"]
    layer = next(m for m in again.modules() if type(m).__name__ == "SharedBasisLinear")
    assert layer.shared() is again.get_submodule(layer.dictionary)


def test_to_dtype_keeps_the_dictionary_reference():
    lm = _lm("llama")
    _run(lm, BasisSharing(ratio=0.3))
    ref = _logits(lm).double()
    lm.model.to(torch.float64)
    for _, m in custom_modules(lm.model):
        if isinstance(m, SharedBasisLinear):
            assert m.shared() is lm.model.get_submodule(m.dictionary)
            assert m.shared().weight.dtype == torch.float64
    got = _logits(lm)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_optimized_pairing_beats_adjacent_on_the_same_data():
    lm = _lm("llama")
    values = _run(lm, SharedDict(ratio=0.4, iters=0))
    for role, errs in values["pairing_error"].items():
        assert errs["chosen"] <= errs["adjacent"] * (1 + 1e-12), role


def test_optimized_pairing_finds_the_layers_that_share_a_basis():
    """q of layers 0 and 2 (and 1 and 3) are the same rank-4 matrix: paired, they share a
    rank-4 dictionary exactly; adjacent pairs cannot."""
    lm = _lm("llama")
    ad = lm.adapter
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a, b in ((0, 2), (1, 3)):
            w = torch.randn(32, 4, generator=g) @ torch.randn(4, 32, generator=g)
            ad.attn_projections(a)["q"].weight.copy_(w)
            ad.attn_projections(b)["q"].weight.copy_(w)
    opt = _run(lm, SharedDict(rank=4, types="q", iters=0))
    assert opt["groups"]["q"] == [[0, 2], [1, 3]]
    assert opt["pairing_error"]["q"]["chosen"] < 1e-6 * opt["pairing_error"]["q"]["adjacent"]
    adj = _run(_lm_with_same_q(), SharedDict(rank=4, types="q", iters=0, pairing="adjacent"))
    assert adj["groups"]["q"] == [[0, 1], [2, 3]]
    assert adj["error"]["q"] > 1e3 * opt["error"]["q"]


def _lm_with_same_q():
    lm = _lm("llama")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a, b in ((0, 2), (1, 3)):
            w = torch.randn(32, 4, generator=g) @ torch.randn(4, 32, generator=g)
            lm.adapter.attn_projections(a)["q"].weight.copy_(w)
            lm.adapter.attn_projections(b)["q"].weight.copy_(w)
    return lm


def test_alternating_history_in_the_report_is_monotone_and_below_basis_sharing():
    lm = _lm("qwen3")
    values = _run(lm, SharedDict(ratio=0.4, iters=10, pairing="adjacent", sequential=False,
                                 shrink=0.0))
    bs = _run(_lm("qwen3"), BasisSharing(ratio=0.4))
    for role, hist in values["objective_history"].items():
        assert all(b <= a for a, b in zip(hist, hist[1:], strict=False)), role
        assert hist[-1] < hist[0]
        assert hist[0] == pytest.approx(bs["error"][role], rel=1e-9)  # same start


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_ratio_budget_met(ratio):
    lm = _lm("llama")
    values = _run(lm, BasisSharing(ratio=ratio))
    ad = lm.adapter
    paths = {**ad.spec.attn_proj, **ad.spec.mlp_proj}
    for role, groups in values["groups"].items():
        d_in, out = in_out_features(ad.linears(0)[paths[role]])  # uniform tiny widths
        layers = sum(len(g) for g in groups)
        dense = layers * out * d_in
        per_rank = len(groups) * d_in + layers * out
        kept = values["ranks"][role] * per_rank
        assert kept <= (1 - ratio) * dense < kept + per_rank


@pytest.mark.parametrize("method", [BasisSharing, SharedDict])
def test_target_params_met(method):
    lm = _lm("llama")
    values = _run(lm, method(target_params=0.8))
    slack = sum(len(g) * 32 + sum(len(x) for x in g) * 48 for g in values["groups"].values())
    assert values["kept_params"] <= 0.8
    assert values["params_after"] + slack > 0.8 * values["params_before"]


def test_errors():
    with pytest.raises(ConfigError, match="types"):
        BasisSharing(types="q,foo")
    with pytest.raises(ConfigError, match="not both"):
        SharedDict(rank=3, target_params=0.5)
    with pytest.raises(ConfigError, match="pairing"):
        SharedDict(pairing="random")
    with pytest.raises(ConfigError, match="ratio"):
        BasisSharing(ratio=1.0)
    with pytest.raises(UnsupportedOperationError, match="none of the projection types"):
        SharedDict(types="q,k").precheck(_lm("gpt2"))
    with pytest.raises(UnsupportedOperationError, match="at least 8 blocks"):
        BasisSharing(group=8).precheck(_lm("llama"))
    lm = _lm("llama")
    _run(lm, BasisSharing(ratio=0.3, types="q"))
    with pytest.raises(UnsupportedOperationError, match="already factorized"):
        BasisSharing(types="q").precheck(lm)
    with pytest.raises(ConfigError, match="target_params"):
        _run(_lm("llama"), BasisSharing(target_params=0.01))


# ------------------------------------------------------------------ coefficient sparsity
def test_choose_atoms_respects_the_budget_and_gives_every_layer_one():
    ws, hs = _problem(3, out=6, d_in=8)
    d, cs = sm.basis_sharing(ws, hs, 6)
    for budget in (18, 40, 6 * 18):
        atoms = sm.choose_atoms(ws, hs, d, cs, budget)
        assert all(len(a) >= 1 for a in atoms)
        assert 6 * sum(len(a) for a in atoms) <= max(budget, 18)
    assert [len(a) for a in sm.choose_atoms(ws, hs, d, cs, 6 * 18)] == [6, 6, 6]


def test_sparse_coefficients_share_disjoint_subspaces_exactly_within_the_dense_budget():
    """Two layers whose rows span orthogonal 4-dim subspaces: a rank-8 dictionary where
    each layer uses its own 4 atoms reproduces both at the budget of a dense rank 5
    (5 * (32 + 2*48) = 640 = 8*32 + 48*(4+4)); the dense rank-5 dictionary cannot."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64))
    scales = torch.linspace(1, 2, 8, dtype=torch.float64)
    ws = [torch.randn(48, 4, generator=g, dtype=torch.float64) @ (q[:, 4 * i:4 * i + 4]
          * scales[4 * i:4 * i + 4]).t() for i in range(2)]
    hs = [torch.eye(32, dtype=torch.float64)] * 2
    d, cs, hist, atoms = SharedDict(expand=1.6, iters=5)._sparse(ws, hs, 5)
    assert d.shape == (8, 32) and [len(a) for a in atoms] == [4, 4]
    assert d.numel() + sum(c.numel() for c in cs) == 640
    assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))
    for w, c, a in zip(ws, cs, atoms, strict=True):
        torch.testing.assert_close(c @ d[a], w, atol=1e-8, rtol=1e-8)
    dd, dcs, dense_hist, _ = SharedDict(iters=5)._factor(ws, hs, 5)
    assert dd.numel() + sum(c.numel() for c in dcs) == 640
    assert dense_hist[-1] > 1.0 and hist[-1] < 1e-12


def test_sparse_shared_dict_on_a_model_budget_flops_and_reload(tmp_path):
    lm = _lm("llama")
    dense = _run(_lm("llama"), SharedDict(ratio=0.5, iters=3, pairing="adjacent"))
    values = _run(lm, SharedDict(ratio=0.5, iters=3, expand=1.5, pairing="adjacent"))
    assert values["params_after"] <= dense["params_after"]
    basis = [m for _, m in custom_modules(lm.model) if isinstance(m, SharedBasisLinear)]
    assert any(m.rank < m.dictionary_rank for m in basis)
    expected = sum(2 * (m.rank * m.in_features + m.out_features * m.rank) for m in basis)
    dense_flops = sum(2 * in_out_features(m)[0] * in_out_features(m)[1]
                      for m in _targets(_lm("llama"), sh.DEFAULT_TYPES.split(",")))
    assert values["flops_per_token_after"] == values["flops_per_token_before"] \
        - dense_flops + expected
    for hist in values["objective_history"].values():
        assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))
    ref = _logits(lm)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits, ref,
                                   rtol=0, atol=0)


def test_sequential_grams_see_earlier_stages():
    """q/k/v come first: the same with and without ``sequential``; gate/up read the MLP
    input, which changed once attention was compressed."""
    seq = _run(_lm("llama"), SharedDict(ratio=0.5, iters=2, sequential=True))
    dense = _run(_lm("llama"), SharedDict(ratio=0.5, iters=2, sequential=False))
    for role in ("q", "k", "v"):
        assert seq["groups"][role] == dense["groups"][role]
        assert seq["error"][role] == pytest.approx(dense["error"][role], rel=1e-9)
    for role in ("gate", "up"):
        assert seq["error"][role] != pytest.approx(dense["error"][role], rel=1e-6)


@pytest.mark.parametrize("masked", ["one layer", "atom unused"])
def test_dictionary_step_with_zero_coefficient_columns(masked):
    """A_2 singular (layer 2 skips atoms): the per-column solve; an atom no layer uses:
    conjugate gradients. Either way the normal equations hold where they can."""
    ws, hs = _problem(2, seed=7)
    d, _ = sm.basis_sharing(ws, hs, 4)
    atoms = [torch.tensor([0, 1, 2, 3]), torch.tensor([1, 3])]
    if masked == "atom unused":
        atoms = [torch.tensor([0, 1, 2]), torch.tensor([1])]
    cs = [sm.masked_coefficients(w, h, d, a) for w, h, a in zip(ws, hs, atoms, strict=True)]
    before = sm.objective(ws, hs, d, cs)
    new_d = sm.dictionary_step(ws, hs, cs, d, sm.pencil(hs[0], hs[1]))
    grad = sum(c.t() @ (w - c @ new_d) @ h for w, h, c in zip(ws, hs, cs, strict=True))
    assert float(grad.abs().max()) < 1e-6
    assert sm.objective(ws, hs, new_d, cs) <= before
    if masked == "atom unused":  # CG from d leaves the unused row alone
        torch.testing.assert_close(new_d[3], d[3])
