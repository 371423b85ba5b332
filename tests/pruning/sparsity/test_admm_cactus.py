"""ADMM weight update (Boza 2024) and CACTUS (Kronecker curvature, sparse + low-rank):
the W-step against a direct Kronecker solve, ADMM against SparseGPT on SparseGPT's own
mask, G = I against the plain update, rank 0 / full rank, exact masks, the output
gradient covariances against autograd, and checkpoints of S + L."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.calib.stats import Gram
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.divergence import nll_sum
from prunelab.models.loading import wrap
from prunelab.pruning.sparsity.methods.admm import (
    Admm,
    AdmmSettings,
    Coords,
    admm_solve,
    cubic_sparsity,
    factor,
    lowrank_in_metric,
)
from prunelab.pruning.sparsity.methods.cactus import (
    Cactus,
    OutputGradCov,
    output_gradient_covariances,
)
from prunelab.pruning.sparsity.sparse_lowrank import SparseLowRankLinear, stored_params
from prunelab.pruning.sparsity.sparsegpt import sparsegpt_prune

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def layer(seed: int, d_out: int = 12, d_in: int = 32, tokens: int = 200):
    """Random weight and correlated inputs (a few outlier channels), with their Gram."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=g) / d_in ** 0.5 + torch.eye(d_in)
    x = torch.randn(tokens, d_in, generator=g) @ mix
    x[:, :3] *= 5.0
    w = torch.randn(d_out, d_in, generator=g)
    gram = Gram(torch.float32)
    gram.update(x)
    return w, x, [gram]


def recon(x, w, w_hat) -> float:
    return float((x.double() @ (w.double() - w_hat.double()).t()).pow(2).sum())


def spd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    return m @ m.t() / (2 * d) + 0.1 * torch.eye(d, dtype=torch.float64)


def test_cubic_schedule_hand_values():
    assert cubic_sparsity(0.5, 14, 15) == 0.5
    assert cubic_sparsity(0.5, 0, 15) == pytest.approx(0.5 * (1 - (14 / 15) ** 3))
    assert cubic_sparsity(0.5, 20, 15) == 0.5


def test_w_step_solves_the_kronecker_system():
    """One iteration with unit-diagonal A, G and no damping: the elementwise eigen-basis
    W-step equals the direct solve of (A kron G + rho I) vec(W) = (A kron G) vec(W0) +
    rho vec(V), V = Z - U."""
    d_out, d_in, rho = 3, 4, 0.7
    a, gm = spd(d_in, 1), spd(d_out, 2)
    a = a / a.diagonal().sqrt()[:, None] / a.diagonal().sqrt()[None, :]
    gm = gm / gm.diagonal().sqrt()[:, None] / gm.diagonal().sqrt()[None, :]
    w0 = torch.randn(d_out, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    keep = torch.rand(d_out, d_in, generator=torch.Generator().manual_seed(4)) > 0.5
    s, _, _ = admm_solve(w0, factor(a, 0.0), factor(gm, 0.0), keep,
                         AdmmSettings(iterations=1, rho=rho))
    z = w0 * keep
    u = w0 - z
    v = z - u
    k = torch.kron(a, gm)  # column-major vec: vec(G W A) = (A kron G) vec(W)
    vec = lambda m: m.t().reshape(-1)  # noqa: E731
    sol = torch.linalg.solve(k + rho * torch.eye(d_out * d_in, dtype=torch.float64),
                             k @ vec(w0) + rho * vec(v))
    w1 = sol.reshape(d_in, d_out).t()
    torch.testing.assert_close(s.double(), (w1 + u) * keep, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_admm_on_sparsegpt_mask_never_worse_than_sparsegpt(seed, pattern):
    w, x, accs = layer(seed)
    sparse = {"pattern": pattern} if pattern else {"sparsity": 0.5}
    ref, keep = sparsegpt_prune(w, accs[0].xtx.float(), 0.5, pattern=pattern)
    new = Admm(mask_from="sparsegpt", **sparse).prune_weight(w, accs, 0.5)
    assert torch.equal(new != 0, keep)  # the very same mask
    assert recon(x, w, new) <= recon(x, w, ref)


@pytest.mark.parametrize("gradual", [False, True])
def test_cactus_with_identity_g_is_the_plain_admm_update(gradual):
    w, x, accs = layer(7)
    plain = Admm(gradual=gradual).prune_weight(w, accs, 0.5)
    cov = OutputGradCov()
    cov.ggt, cov.tokens = 3.0 * torch.eye(w.shape[0], dtype=torch.float64), 7  # G = 3/7 I
    cactus = Cactus(gradual=gradual, grad_damp=0.0).prune_weight(w, accs + [cov], 0.5)
    torch.testing.assert_close(cactus, plain, rtol=1e-4, atol=1e-5)
    assert torch.equal(cactus != 0, plain != 0)


def test_gradient_curvature_changes_the_solution():
    w, x, accs = layer(8)
    cov = OutputGradCov()
    cov.update(torch.randn(40, w.shape[0], generator=torch.Generator().manual_seed(0))
               * torch.linspace(0.1, 3, w.shape[0]))
    plain = Admm(mask_from="wanda").prune_weight(w, accs, 0.5)
    cactus = Cactus(mask_from="wanda", gradual=False).prune_weight(w, accs + [cov], 0.5)
    assert torch.equal(cactus != 0, plain != 0)  # same Wanda mask
    assert not torch.allclose(cactus, plain, atol=1e-3)


@pytest.mark.parametrize(("cfg", "zeros_per_row"), [
    (Admm(sparsity=0.5), 16), (Admm(sparsity=0.3, gradual=True), 9),
    (Admm(mask_from="magnitude", sparsity=0.6), 19), (Cactus(sparsity=0.25), 8),
])
def test_unstructured_masks_are_exact_per_row(cfg, zeros_per_row):
    w, _, accs = layer(2)
    if isinstance(cfg, Cactus):
        cov = OutputGradCov()
        cov.update(torch.randn(30, w.shape[0], generator=torch.Generator().manual_seed(1)))
        accs = accs + [cov]
    out = cfg.prune_weight(w, accs, cfg.sparsity)
    assert ((out == 0).sum(1) == zeros_per_row).all()


@pytest.mark.parametrize("cfg", [Admm(pattern="2:4"), Admm(pattern="2:4", gradual=True),
                                 Admm(pattern="1:4", mask_from="sparsegpt")])
def test_nm_masks_are_exact(cfg):
    w, _, accs = layer(3)
    out = cfg.prune_weight(w, accs, 0.5)
    n = cfg.nm[0]
    assert ((out != 0).reshape(w.shape[0], -1, 4).sum(-1) == n).all()


def test_lowrank_rank_zero_is_plain_and_full_rank_reproduces_w():
    w, _, accs = layer(5)
    fa, fg = factor(accs[0].xtx, 0.1), factor(spd(w.shape[0], 9), 0.1)
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) > 0.5
    st = dict(iterations=20, target=0.5)
    plain, left0, _ = admm_solve(w, fa, fg, keep, AdmmSettings(**st))
    zero, _, _ = admm_solve(w, fa, fg, keep, AdmmSettings(rank=0, **st))
    assert left0 is None and torch.equal(plain, zero)
    s, left, right = admm_solve(w, fa, fg, keep, AdmmSettings(rank=w.shape[0], **st))
    assert torch.equal(s != 0, keep & (s != 0)) and not (s[~keep] != 0).any()
    torch.testing.assert_close(s + left @ right, w, rtol=1e-3, atol=1e-3)
    part, left2, right2 = admm_solve(w, fa, fg, keep, AdmmSettings(rank=2, **st))
    assert left2.shape == (w.shape[0], 2) and right2.shape == (2, w.shape[1])


def test_lowrank_is_optimal_in_the_metric():
    """The whitened truncated SVD beats the Euclidean one in the metric norm."""
    d_out, d_in, r = 6, 8, 2
    fa, fg = factor(spd(d_in, 1), 0.0), factor(spd(d_out, 2), 0.0)
    c = Coords(fa, fg, "cpu", torch.float64)
    m = torch.randn(d_out, d_in, dtype=torch.float64)
    a_half = c.r @ torch.diag(c.a.sqrt()) @ c.r.t()
    g_half = c.p @ torch.diag(c.g.sqrt()) @ c.p.t()
    err = lambda low: float((g_half @ (m - low) @ a_half).norm())  # noqa: E731
    low, left, right = lowrank_in_metric(c, m, r)
    torch.testing.assert_close(low, left @ right)
    assert torch.linalg.matrix_rank(low) == r
    u, s, vh = torch.linalg.svd(m)
    assert err(low) < err(u[:, :r] * s[:r] @ vh[:r])
    assert lowrank_in_metric(c, m, 0)[0].abs().max() == 0


def test_output_gradient_covariances_match_autograd():
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    lin = lm.adapter.linears(1)["mlp.down_proj"]
    got = output_gradient_covariances(lm, IDS, {"1:down": lin}, batch_size=2)["1:down"]
    outs = []

    def keep(_module, _inputs, out):
        out.retain_grad()
        outs.append(out)

    handle = lin.register_forward_hook(keep)
    try:
        for ids in IDS.split(2):
            logits = lm.model(input_ids=ids, use_cache=False).logits
            nll_sum(logits, ids).backward()
    finally:
        handle.remove()
    g = torch.cat([o.grad.reshape(-1, o.shape[-1]) for o in outs]).double()
    assert got.tokens == IDS.numel()
    torch.testing.assert_close(got.mean(), g.t() @ g / IDS.numel(), rtol=1e-4, atol=1e-9)


def test_config_errors():
    with pytest.raises(ConfigError, match="mask-from"):
        Admm(mask_from="owl")
    with pytest.raises(ConfigError, match="gradual-iterations"):
        Admm(gradual=True, iterations=5, gradual_iterations=6)
    with pytest.raises(ConfigError, match="rank"):
        Cactus(rank=-1)
    lm = wrap(tiny_model("bert"), char_tokenizer(), spec="tiny-bert")
    with pytest.raises(UnsupportedOperationError, match="LM head"):
        prunelab.prune(lm, Cactus(), CALIB)


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS[:2], use_cache=False).logits


def test_sparse_plus_lowrank_checkpoint_reloads_with_identical_logits(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    rep = prunelab.prune(lm, Cactus(sparsity=0.5, rank=2), CALIB, batch_size=2)
    mods = [m for m in lm.model.modules() if isinstance(m, SparseLowRankLinear)]
    assert len(mods) == 7 * lm.adapter.num_blocks
    assert rep["achieved_sparsity"] == 0.5 and rep["rank"] == 2
    assert rep["stored_params"] == sum(stored_params(m) for m in mods)
    assert rep["lowrank_params"] == sum(2 * (m.in_features + m.out_features) for m in mods)
    ref = logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    kinds = {m["kind"] for m in json.loads((out / "config.json").read_text())["prunelab_modules"]}
    assert kinds == {"sparse_lowrank_linear"}
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    torch.testing.assert_close(logits(again), ref, rtol=0, atol=0)


def test_fold_lowrank_is_a_plain_checkpoint_with_the_same_function(tmp_path):
    models = {}
    for fold in (False, True):
        lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
        prunelab.prune(lm, Cactus(sparsity=0.5, rank=2, fold_lowrank=fold), CALIB,
                       batch_size=2)
        models[fold] = lm
    assert not any(isinstance(m, SparseLowRankLinear) for m in models[True].model.modules())
    out = prunelab.save(models[True], tmp_path / "folded")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=models[True].model.config._attn_implementation).eval()
    torch.testing.assert_close(logits(again), logits(models[True].model), rtol=0, atol=0)
    torch.testing.assert_close(logits(models[True].model), logits(models[False].model),
                               rtol=1e-4, atol=1e-4)


def test_rank_zero_cactus_prunes_like_its_solver_and_saves_plain(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    prunelab.prune(lm, Cactus(sparsity=0.5), CALIB, batch_size=2)
    assert not any(isinstance(m, SparseLowRankLinear) for m in lm.model.modules())
    out = prunelab.save(lm, tmp_path / "plain")
    assert "prunelab_modules" not in json.loads((out / "config.json").read_text())


def test_randomized_truncated_svd_is_near_optimal_and_deterministic():
    """Small ranks use a seeded randomized SVD: within 1 % of the exact truncation's
    metric error, and the same factors twice."""
    d_out, d_in, r = 40, 48, 4
    fa, fg = factor(spd(d_in, 3), 0.0), factor(spd(d_out, 4), 0.0)
    c = Coords(fa, fg, "cpu", torch.float64)
    g = torch.Generator().manual_seed(5)
    m = (torch.randn(d_out, 8, generator=g, dtype=torch.float64)
         @ torch.randn(8, d_in, generator=g, dtype=torch.float64)
         + 0.05 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64))
    w = c.rot(m) * c.g.sqrt()[:, None] * c.a.sqrt()[None, :]
    s = torch.linalg.svdvals(w)
    best = float(s[r:].pow(2).sum().sqrt())
    low, _, _ = lowrank_in_metric(c, m, r)
    err = float((c.rot(m - low) * c.g.sqrt()[:, None] * c.a.sqrt()[None, :]).norm())
    assert best * (1 - 1e-9) <= err <= 1.01 * best
    assert torch.equal(low, lowrank_in_metric(c, m, r)[0])
