"""Issue 14, second round: the cheap pair proxies and candidate pairs of the optimized
shared dictionary, Gram shrinkage, the KL-selected sensitivity basis, and the output
Fisher computed one window at a time."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_factor_shared import _problem as _shared_problem

from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.factor import shared_math as sm
from prunelab.pruning.factor.config import FactorPruner
from prunelab.pruning.factor.fisher import output_fisher
from prunelab.pruning.factor.select import mean_kl
from prunelab.pruning.factor.shared import SharedDict
from prunelab.pruning.factor.slicing import SliceGPT, slice_stream

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

CALIB = tiny_tokens(4, 16, seed=1)


def _lm(arch="llama"):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _problem(n_layers=6, out=6, d_in=8, tokens=40, seed=0, same_gram=False):
    """test_factor_shared's weights and damped Grams; ``same_gram``: every layer gets the
    first layer's Gram."""
    ws, hs = _shared_problem(n_layers, out, d_in, tokens, seed)
    return ws, ([hs[0]] * n_layers if same_gram else hs)


# ------------------------------------------------------------------ pair proxies
def test_pair_proxy_bounds_the_basis_sharing_error_and_is_exact_for_equal_layers():
    """With one Gram for every layer the mean Gram is that Gram: the proxy (one layer's
    own basis shared) is an upper bound of Basis Sharing's own-Gram error of the pair
    (Eckart-Young), and equal to it when the two layers are the same."""
    ws, hs = _problem(5, same_gram=True)
    ws[4] = ws[1].clone()
    proxy = sm.pair_proxies(ws, hs, 3)
    for a, b in itertools.combinations(range(5), 2):
        d, cs = sm.basis_sharing([ws[a], ws[b]], [hs[a], hs[b]], 3)
        want = sm.objective([ws[a], ws[b]], [hs[a], hs[b]], d, cs)
        assert float(proxy[a, b]) >= want * (1 - 1e-9)
        if (a, b) == (1, 4):
            assert float(proxy[a, b]) == pytest.approx(want, rel=1e-9)
        assert proxy[a, b] == proxy[b, a]
    assert float(proxy.diagonal().abs().max()) == 0


def test_candidate_pairs_keep_adjacent_and_each_layers_best():
    proxy = torch.tensor([[0, 9, 1, 9], [9, 0, 9, 2], [1, 9, 0, 9], [9, 2, 9, 0]],
                         dtype=torch.float64)
    got = sm.candidate_pairs(proxy, 1)
    assert got == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]
    assert len(sm.candidate_pairs(proxy, 3)) == 6  # every pair


# ------------------------------------------------------------------ shrinkage
def test_shrunk_grams_interpolate_and_full_shrink_leaves_basis_sharing_optimal():
    ws, hs = _problem(2, seed=3)
    assert sm.shrunk(hs, 0.0) == hs
    mean = (hs[0] + hs[1]) / 2
    for h in sm.shrunk(hs, 1.0):
        torch.testing.assert_close(h, mean)
    half = sm.shrunk(hs, 0.5)
    torch.testing.assert_close(half[0], 0.5 * hs[0] + 0.5 * mean)
    # one shared metric: Basis Sharing's SVD is the optimum, the alternation cannot gain
    one = sm.shrunk(hs, 1.0)
    d, cs = sm.basis_sharing(ws, one, 3)
    _, _, hist = sm.alternate(ws, one, d, cs, iters=5)
    assert hist[-1] == pytest.approx(hist[0], rel=1e-9)
    # own Grams: the alternation lowers the objective, monotonically
    d, cs = sm.basis_sharing(ws, hs, 3)
    _, _, hist = sm.alternate(ws, hs, d, cs, iters=5)
    assert all(b <= a for a, b in zip(hist, hist[1:], strict=False))
    assert hist[-1] < hist[0]


def _run(lm, cfg):
    cfg.precheck(lm)
    return FactorPruner().run(lm, cfg, CALIB, batch_size=2).values


def test_candidate_scoring_matches_full_scoring_when_every_pair_is_a_candidate():
    full = _run(_lm(), SharedDict(rank=6, candidates=0, iters=2, sequential=False))
    many = _run(_lm(), SharedDict(rank=6, candidates=3, iters=2, sequential=False))
    few = _run(_lm(), SharedDict(rank=6, candidates=1, iters=2, sequential=False))
    n = 4  # tiny llama: 4 blocks, 6 pairs
    for role in full["groups"]:
        assert full["pairing_error"][role]["scored_pairs"] == n * (n - 1) // 2
        assert many["groups"][role] == full["groups"][role]
        assert few["pairing_error"][role]["scored_pairs"] <= n * (n - 1) // 2
        # adjacent pairs are always scored, so the chosen pairing is never worse
        assert few["pairing_error"][role]["chosen"] <= \
            few["pairing_error"][role]["adjacent"] * (1 + 1e-12)


def test_equal_budget_whatever_the_shrinkage_and_pairing():
    """Stored parameters do not depend on the pairing, the shrinkage or the candidates."""
    sizes = set()
    for cfg in (SharedDict(ratio=0.4, shrink=0.0), SharedDict(ratio=0.4, shrink=1.0),
                SharedDict(ratio=0.4, pairing="adjacent", shrink=0.5)):
        sizes.add(_run(_lm(), cfg)["params_after"])
    assert len(sizes) == 1


def test_shared_dict_options_validated():
    with pytest.raises(ConfigError, match="shrink"):
        SharedDict(shrink=1.5)
    with pytest.raises(ConfigError, match="candidates"):
        SharedDict(candidates=-1)


# ------------------------------------------------------------------ KL-selected basis
def test_kl_selection_never_above_pca_and_applies_the_winner():
    ids = CALIB
    dense = _lm()
    lm = _lm()
    rep = _run(lm, SliceGPT(ratio=0.5, multiple=4, basis="sensitivity", select="kl",
                            select_grid="0.01,1", select_windows=0))
    kls = {(s["basis"], s["fisher_damping"]): s["calib_kl"] for s in rep["selection"]}
    assert len(kls) == 3 and ("pca", None) in kls
    best = min(kls.values())
    assert best <= kls[("pca", None)]
    assert rep["basis_used"] in ("pca", "sensitivity")
    # the model left behind is the winner: its measured KL is the selected candidate's
    got = mean_kl(dense.model, lm.model, ids, batch_size=2)
    assert got == pytest.approx(best, rel=1e-5, abs=1e-7)
    # and a plain PCA slice has exactly the PCA candidate's KL
    pca = _lm()
    slice_stream(pca, SliceGPT(ratio=0.5, multiple=4), ids, batch_size=2)
    assert mean_kl(dense.model, pca.model, ids, batch_size=2) == \
        pytest.approx(kls[("pca", None)], rel=1e-5, abs=1e-7)


def test_select_options_validated():
    with pytest.raises(ConfigError, match="select"):
        SliceGPT(basis="sensitivity", select="best")
    with pytest.raises(ConfigError, match="select_grid"):
        SliceGPT(basis="sensitivity", select_grid="a,b")
    with pytest.raises(ConfigError, match="select_grid"):
        SliceGPT(basis="sensitivity", select_grid="0.1,-1")


# ------------------------------------------------------------------ Fisher memory
def test_output_fisher_does_not_depend_on_batch_size():
    """One window per backward whatever batch_size is: the same draws, the same sums."""
    from prunelab.pruning.factor.folding import stream_boundaries

    lm = _lm()
    mods = stream_boundaries(lm)
    a = output_fisher(lm, CALIB, mods, batch_size=1, samples=2, seed=3)
    b = output_fisher(lm, CALIB, mods, batch_size=4, samples=2, seed=3)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_fast_pair_error_equals_the_svd_route():
    ws, hs = _problem(2, out=10, d_in=8, seed=7)
    d, cs = sm.basis_sharing(ws, hs, 3)
    cs = [sm.coefficient_step(w, h, d) for w, h in zip(ws, hs, strict=True)]
    want = sm.objective(ws, hs, d, cs)
    assert sm.pair_error(ws, hs, 3) == pytest.approx(want, rel=1e-9)
    d2 = sm.basis_sharing_dictionary(ws, hs, 3)
    # same row space as Basis Sharing's dictionary
    proj = d2.t() @ torch.linalg.pinv(d2.t())
    torch.testing.assert_close(proj @ d.t(), d.t(), atol=1e-9, rtol=1e-9)
