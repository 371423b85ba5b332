"""Sensitivity-aware residual-stream subspaces: PCA, the Fisher-weighted KL proxy, the
refined basis, widths under a budget, and the output Fisher / activation covariance."""

from __future__ import annotations

import math

import pytest
import torch

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.loading import wrap
from prunelab.pruning.factor.fisher import activation_covariance, output_fisher
from prunelab.pruning.factor.subspace import (
    kl_proxy,
    pca_basis,
    proxy_curve,
    refine_subspace,
    sensitivity_basis,
    widths_for_budget,
    widths_for_energy,
)

from tiny_models import VOCAB, char_tokenizer, tiny_model, tiny_tokens

D64 = torch.float64


def _psd(d: int, rank: int, g: torch.Generator, scale: torch.Tensor | None = None):
    x = torch.randn(d, rank, generator=g, dtype=D64)
    if scale is not None:
        x = x * scale[:, None]
    return x @ x.T / rank


def _projector(q: torch.Tensor) -> torch.Tensor:
    return q @ q.T


def _random_pairs(n: int, d: int = 12, seed: int = 0):
    """Seeded (C, F) pairs: isotropic, anisotropic with shuffled spectra, low-rank F."""
    g = torch.Generator().manual_seed(seed)
    decay = torch.logspace(0, -2, d, dtype=D64)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            yield _psd(d, 2 * d, g), _psd(d, 2 * d, g)
        elif kind == 1:
            yield (_psd(d, 2 * d, g, decay),
                   _psd(d, 2 * d, g, decay[torch.randperm(d, generator=g)]))
        else:
            yield _psd(d, 2 * d, g, decay), _psd(d, 3, g)


# ---------------------------------------------------------------- PCA and the proxy


def test_pca_basis_hand_matrix():
    cov = torch.tensor([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 5.0]])
    q, vals = pca_basis(cov)
    assert q.dtype == D64 and vals.dtype == D64
    torch.testing.assert_close(vals, torch.tensor([5.0, 3.0, 1.0], dtype=D64))
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(q[:, 0], torch.tensor([0.0, 0.0, 1.0], dtype=D64))
    torch.testing.assert_close(q[:, 1], torch.tensor([r, r, 0.0], dtype=D64))
    assert torch.allclose(q[:, 2].abs(), torch.tensor([r, r, 0.0], dtype=D64))
    assert q[0, 2] * q[1, 2] < 0


def test_kl_proxy_hand_2x2():
    cov = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
    fisher = torch.tensor([[1.0, 1.0], [1.0, 2.0]])
    e1 = torch.tensor([[1.0], [0.0]])
    diag = torch.tensor([[1.0], [1.0]], dtype=D64) / math.sqrt(2)
    # keep e1: (I-P) F (I-P) = [[0, 0], [0, 2]], times C: trace 2
    assert kl_proxy(cov, fisher, e1) == pytest.approx(1.0, abs=1e-12)
    # keep (1, 1)/sqrt2: I-P = v v^T / 2 with v = (1, -1); v^T F v = 1, v^T C v = 5
    assert kl_proxy(cov, fisher, diag) == pytest.approx(5 / 8, abs=1e-12)
    assert kl_proxy(cov, fisher, torch.zeros(2, 0)) == pytest.approx(3.0, abs=1e-12)
    assert kl_proxy(cov, fisher, torch.eye(2)) == pytest.approx(0.0, abs=1e-12)
    q = torch.cat([diag, torch.tensor([[1.0], [-1.0]], dtype=D64) / math.sqrt(2)], 1)
    torch.testing.assert_close(proxy_curve(cov, fisher, q),
                               torch.tensor([3.0, 5 / 8, 0.0], dtype=D64))


# ---------------------------------------------------------------- sensitivity basis


@pytest.mark.parametrize("scale", [1.0, 7.5])
def test_sensitivity_with_isotropic_fisher_is_pca(scale):
    g = torch.Generator().manual_seed(3)
    cov = _psd(10, 20, g)
    fisher = scale * torch.eye(10, dtype=D64)
    pq, vals = pca_basis(cov)
    q, scores = sensitivity_basis(cov, fisher)
    for k in range(1, 10):
        torch.testing.assert_close(_projector(q[:, :k]), _projector(pq[:, :k]))
    # the scores are then the eigenvalues times the (damped) scale / 2
    torch.testing.assert_close(scores, vals * scale * 1.01 / 2)
    for k in (3, 6):
        res = sensitivity_basis(cov, fisher, k=k)
        torch.testing.assert_close(_projector(res[0][:, :k]), _projector(pq[:, :k]))
        assert res.proxy == pytest.approx(res.pca_proxy, rel=1e-9)


def test_sensitivity_basis_orthonormal_nested_and_scored():
    for cov, fisher in _random_pairs(3, d=9, seed=5):
        for k in (None, 4):
            res = sensitivity_basis(cov, fisher, damping=0.05, k=k)
            q, scores = res
            torch.testing.assert_close(q.T @ q, torch.eye(9, dtype=D64))
            # scores are the proxy (damped Fisher) saved by each column in order
            fd = fisher + 0.05 * fisher.diagonal().mean() * torch.eye(9, dtype=D64)
            curve = torch.tensor([kl_proxy(cov, fd, q[:, :j]) for j in range(10)], dtype=D64)
            torch.testing.assert_close(curve[0] - scores.cumsum(0), curve[1:])
            if k is not None:
                assert res.proxy == pytest.approx(kl_proxy(cov, fisher, q[:, :k]), rel=1e-9)


def test_nested_candidate_spans_top_eigenvectors_of_cf():
    """The "range" candidate: span(Q[:, :k]) = top-k eigenvectors of C F for every k."""
    g = torch.Generator().manual_seed(11)
    d = 8
    cov, fisher = _psd(d, 3 * d, g), _psd(d, 3 * d, g)
    res = sensitivity_basis(cov, fisher, damping=0.0)
    assert res.source == "range"  # for this seeded pair
    vals, vecs = torch.linalg.eig(cov @ fisher)
    order = vals.real.argsort(descending=True)
    v = vecs.real[:, order]
    for k in range(1, d):
        p = _projector(res[0][:, :k])
        assert torch.linalg.norm(v[:, :k] - p @ v[:, :k]) < 1e-8


def test_sensitivity_never_worse_than_pca_on_random_pairs():
    better = total = 0
    for cov, fisher in _random_pairs(12, d=12, seed=0):
        pq, _ = pca_basis(cov)
        for k in (2, 5, 9):
            res = sensitivity_basis(cov, fisher, k=k)
            pca = kl_proxy(cov, fisher, pq[:, :k])
            assert res.pca_proxy == pytest.approx(pca, rel=1e-9)
            assert res.proxy <= pca * (1 + 1e-12)
            better += res.proxy < 0.999 * pca
            total += 1
    assert better >= 0.9 * total, (better, total)


def test_one_rotation_for_several_boundaries_sums_the_proxies():
    pairs = list(_random_pairs(3, d=10, seed=8))
    covs, fishers = [c for c, _ in pairs], [f for _, f in pairs]
    pq, _ = pca_basis(sum(covs))
    u = pq[:, :4]
    assert kl_proxy(covs, fishers, u) == pytest.approx(
        sum(kl_proxy(c, f, u) for c, f in pairs), rel=1e-12)
    torch.testing.assert_close(proxy_curve(covs, fishers, pq)[4],
                               torch.tensor(kl_proxy(covs, fishers, u), dtype=D64))
    for k in (3, 7):
        res = sensitivity_basis(covs, fishers, k=k)
        assert res.pca_proxy == pytest.approx(kl_proxy(covs, fishers, pq[:, :k]), rel=1e-9)
        assert res.proxy == pytest.approx(kl_proxy(covs, fishers, res[0][:, :k]), rel=1e-9)
        assert res.proxy < 0.99 * res.pca_proxy
    one = sensitivity_basis([covs[0]], [fishers[0]], k=5)
    torch.testing.assert_close(one[0], sensitivity_basis(covs[0], fishers[0], k=5)[0])
    with pytest.raises(ValueError, match="2 covariances for 3"):
        kl_proxy(covs[:2], fishers, u)


def test_refine_subspace_decreases_the_proxy():
    for cov, fisher in _random_pairs(3, d=10, seed=2):
        u0 = pca_basis(cov)[0][:, :4]
        u = refine_subspace(cov, fisher, u0, steps=50)
        torch.testing.assert_close(u.T @ u, torch.eye(4, dtype=D64))
        assert kl_proxy(cov, fisher, u) < kl_proxy(cov, fisher, u0)


# ---------------------------------------------------------------- widths


def test_widths_for_budget_hand():
    s0 = torch.tensor([10.0, 6.0, 2.0, 1.0])
    s1 = torch.tensor([20.0, 16.0, 4.0, 1.0])
    # start at [2, 2] = 6 params; block b0[2:4]: 3 / 2 per param, b1[2:4]: 5 / 4
    assert widths_for_budget([s0, s1], [1, 2], 8, multiple=2, floor=2) == [4, 2]
    assert widths_for_budget([s0, s1], [1, 2], 11, multiple=2, floor=2) == [4, 2]
    assert widths_for_budget([s0, s1], [1, 2], 12, multiple=2, floor=2) == [4, 4]
    assert widths_for_budget([s0, s1], [1, 2], 7, multiple=2, floor=2) == [2, 2]
    s1b = torch.tensor([20.0, 16.0, 8.0, 8.0])  # b1's block: 16 / 4 = 4 per param
    assert widths_for_budget([s0, s1b], [1, 2], 10, multiple=2, floor=2) == [2, 4]
    # floor rounded up to the multiple; an odd size ends in a shorter block
    s2 = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    assert widths_for_budget([s2], [3], 100, multiple=2, floor=3) == [5]
    assert widths_for_budget([s2], [3], 12, multiple=2, floor=3) == [4]
    with pytest.raises(ConfigError, match="below the minimum 12"):
        widths_for_budget([s0, s1], [1, 2], 5, multiple=2, floor=3)


def test_widths_for_energy_hand():
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert widths_for_energy([s], 0.7) == [2]
    assert widths_for_energy([s], 0.71) == [3]
    assert widths_for_energy([s], 1.0) == [4]
    assert widths_for_energy([torch.tensor([1.0, 0.0, 0.0]),
                              torch.tensor([3.0, -1.0, 1.0])], 0.9) == [1, 3]
    with pytest.raises(ValueError):
        widths_for_energy([s], 0.0)


# ---------------------------------------------------------------- Fisher and covariance


def _lm(arch: str = "llama"):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _exact_fisher(lm, block: int, ids: torch.Tensor) -> torch.Tensor:
    """``(1/N) sum_u sum_t sum_y p_t(y) s s^T`` with ``s = d log p_t(y) / d h_u``: the
    block's input replaced by a variable, every label enumerated (vocabulary 131)."""
    model, blk = lm.model, lm.adapter.block(block)
    with torch.no_grad():
        seen = {}
        def grab(_m, a, kw):
            seen["h"] = a[0] if a else kw["hidden_states"]

        hk = blk.register_forward_pre_hook(grab, with_kwargs=True)
        model(input_ids=ids, use_cache=False)
        hk.remove()

    def logp_of(h):
        def swap(_m, a, kw):
            if a:
                return (h,) + tuple(a[1:]), kw
            return a, dict(kw, hidden_states=h)
        handle = blk.register_forward_pre_hook(swap, with_kwargs=True)
        try:
            return torch.log_softmax(model(input_ids=ids, use_cache=False).logits, -1)
        finally:
            handle.remove()

    h0 = seen["h"].detach()
    jac = torch.autograd.functional.jacobian(logp_of, h0, vectorize=True)  # [B,T,V,B,T,d]
    p = logp_of(h0).detach().exp()
    b, t, d = h0.shape
    total = torch.zeros(d, d, dtype=D64)
    for i in range(b):
        for u in range(t):
            s = jac[i, :, :, i, u, :].double()  # [T, V, d]: every output's score at (i, u)
            total += torch.einsum("tv,tva,tvb->ab", p[i].double(), s, s)
    return total / (b * t)


def test_output_fisher_matches_enumerated_fisher():
    lm = _lm()
    window = tiny_tokens(1, 4, seed=7)
    exact = _exact_fisher(lm, 1, window)
    module = lm.adapter.norms(1)[next(iter(lm.adapter.norms(1)))]
    # 400 identical windows x 5 draws = 2000 independent label draws per position
    ids = window.repeat(400, 1)
    (est,) = output_fisher(lm, ids, [module], batch_size=200, samples=5, seed=1)
    torch.testing.assert_close(est, est.T)
    assert torch.linalg.eigvalsh(est).min() > -1e-10 * est.diagonal().sum()
    rel = torch.linalg.norm(est - exact) / torch.linalg.norm(exact)
    # Monte Carlo over 2000 draws: 0.043-0.049 for seeds 0-2; a Fisher of each position's
    # own output only (no later outputs, i.e. a wrong cross-position treatment) is 0.34 away
    assert rel < 0.08, float(rel)


def test_output_fisher_seeded_restores_flags_and_keeps_no_grads():
    lm = _lm()
    ids = tiny_tokens(3, 6, seed=1)
    model = lm.model
    first = next(model.parameters())
    first.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    model.train()
    mods = [lm.adapter.norms(i)[next(iter(lm.adapter.norms(i)))] for i in (0, 2)]
    mods.append(lm.adapter.final_norm())
    a = output_fisher(lm, ids, mods, batch_size=2, samples=2, seed=4)
    b = output_fisher(lm, ids, mods, batch_size=2, samples=2, seed=4)
    c = output_fisher(lm, ids, mods, batch_size=2, samples=2, seed=5)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert len(a) == 3 and all(f.shape == (32, 32) and f.dtype == D64 for f in a)
    for x, y, z in zip(a, b, c, strict=True):
        torch.testing.assert_close(x, y)
        assert not torch.allclose(x, z)


def test_output_fisher_needs_a_head():
    lm = _lm("bert")
    with pytest.raises(UnsupportedOperationError, match="no"):
        output_fisher(lm, tiny_tokens(1, 4), [lm.adapter.block(0)], batch_size=1)


def test_activation_covariance_equals_direct_computation():
    lm = _lm()
    ids = tiny_tokens(5, 7, seed=3)
    mods = [lm.adapter.norms(i)[next(iter(lm.adapter.norms(i)))] for i in (0, 2)]
    covs = activation_covariance(lm, ids, mods, batch_size=2)
    with torch.no_grad():
        hs = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
    for cov, h in zip(covs, (hs[0], hs[2]), strict=True):
        x = h.reshape(-1, h.shape[-1]).double()
        torch.testing.assert_close(cov, x.T @ x / ids.numel())


# ---------------------------------------------------------------- the real check


def _kl_with_projection(lm, block: int, proj: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean KL(dense || model whose stream at ``block``'s input is ``h P``)."""
    p = proj.float()

    def project(_m, a, kw):
        if a:
            return (a[0] @ p,) + tuple(a[1:]), kw
        return a, dict(kw, hidden_states=kw["hidden_states"] @ p)

    with torch.no_grad():
        ref = torch.log_softmax(lm.model(input_ids=ids).logits.double(), -1)
        handle = lm.adapter.block(block).register_forward_pre_hook(project, with_kwargs=True)
        try:
            out = torch.log_softmax(lm.model(input_ids=ids).logits.double(), -1)
        finally:
            handle.remove()
    return float((ref.exp() * (ref - out)).sum(-1).mean())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt"])
def test_sensitivity_subspace_lowers_true_kl_than_pca(arch):
    """At one boundary, on held-out windows: projecting the stream onto the sensitivity
    subspace costs less output KL than PCA's, averaged over three widths."""
    lm = _lm(arch)
    block = 1
    module = lm.adapter.norms(block)[next(iter(lm.adapter.norms(block)))]
    calib, test = tiny_tokens(16, 32, seed=1), tiny_tokens(16, 32, seed=2)
    (cov,) = activation_covariance(lm, calib, [module], batch_size=8)
    (fisher,) = output_fisher(lm, calib, [module], batch_size=8, samples=4)
    pq, _ = pca_basis(cov)
    sens_kl, pca_kl = [], []
    for k in (8, 16, 24):
        res = sensitivity_basis(cov, fisher, k=k)
        assert res.proxy < res.pca_proxy
        sens_kl.append(_kl_with_projection(lm, block, _projector(res[0][:, :k]), test))
        pca_kl.append(_kl_with_projection(lm, block, _projector(pq[:, :k]), test))
    assert sum(sens_kl) < 0.9 * sum(pca_kl), (sens_kl, pca_kl)
    assert VOCAB == 131
