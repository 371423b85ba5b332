"""ADMM's residual stopping rule and SparseGPT warm start (issue 41): the rule on a
hand-computed case, tolerance 0 is the fixed count, a tolerance always met stops after the
first eligible iteration (= one iteration), the warm start reaches the same fixed point as
the cold start and is never worse than SparseGPT, and the option errors."""

from __future__ import annotations

import pytest
import torch

from prunelab.calib.stats import Gram
from prunelab.errors import ConfigError
from prunelab.pruning.sparsity.methods.admm import Admm, converged
from prunelab.pruning.sparsity.methods.cactus import Cactus
from prunelab.pruning.sparsity.sparsegpt import sparsegpt_prune


def layer(seed: int, d_out: int = 12, d_in: int = 32, tokens: int = 200):
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


def test_stopping_rule_hand_values():
    w = torch.tensor([[3.0, 4.0]])          # ||W|| = 5
    s = torch.tensor([[3.0, 3.0]])          # ||W - S|| = 1, ||S|| = 4.243
    s_prev = torch.tensor([[3.0, 2.5]])     # ||S - S_prev|| = 0.5
    u = torch.tensor([[0.0, 2.0]])          # ||U|| = 2
    # primal 1 <= tol * 5 needs tol >= 0.2; dual 0.5 <= tol * 2 needs tol >= 0.25
    assert converged(w, s, s_prev, u, rho=3.0, tol=0.25)
    assert not converged(w, s, s_prev, u, rho=3.0, tol=0.24)
    assert not converged(w, s, s_prev, u * 0.9, rho=3.0, tol=0.25)  # dual side fails
    assert not converged(w, s, s_prev, u, rho=3.0, tol=0.0)  # 0: never


@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_tolerance_met_at_once_is_one_iteration_and_zero_is_the_fixed_count(pattern):
    w, _, accs = layer(1)
    sparse = {"pattern": pattern} if pattern else {"sparsity": 0.5}
    one = Admm(mask_from="sparsegpt", iterations=1, **sparse).prune_weight(w, accs, 0.5)
    loose = Admm(mask_from="sparsegpt", tolerance=1.0, **sparse).prune_weight(w, accs, 0.5)
    full = Admm(mask_from="sparsegpt", **sparse).prune_weight(w, accs, 0.5)
    off = Admm(mask_from="sparsegpt", tolerance=0.0, **sparse).prune_weight(w, accs, 0.5)
    assert torch.equal(loose, one)
    assert torch.equal(off, full)
    assert not torch.equal(one, full)


@pytest.mark.parametrize("seed", range(3))
def test_warm_start_reaches_the_cold_fixed_point_and_beats_sparsegpt(seed):
    w, x, accs = layer(seed)
    ref, keep = sparsegpt_prune(w, accs[0].xtx.float(), 0.5)
    many = {"iterations": 400, "mask_from": "sparsegpt", "sparsity": 0.5}
    cold = Admm(**many).prune_weight(w, accs, 0.5)
    warm = Admm(warm_start=True, **many).prune_weight(w, accs, 0.5)
    torch.testing.assert_close(warm, cold, rtol=1e-3, atol=1e-4)
    few = Admm(warm_start=True, mask_from="sparsegpt", iterations=3).prune_weight(w, accs, 0.5)
    assert torch.equal(few != 0, keep)
    assert recon(x, w, few) <= recon(x, w, ref)


def test_warm_start_at_tolerance_stays_close_to_the_full_run():
    w, x, accs = layer(5)
    full = recon(x, w, Admm(mask_from="sparsegpt", iterations=400).prune_weight(w, accs, 0.5))
    tol = recon(x, w, Admm(mask_from="sparsegpt", warm_start=True, tolerance=1e-3,
                           iterations=400).prune_weight(w, accs, 0.5))
    assert full <= tol <= full * 1.01


def test_option_errors():
    with pytest.raises(ConfigError, match="warm-start"):
        Admm(warm_start=True)  # mask from wanda
    with pytest.raises(ConfigError, match="warm-start"):
        Cactus(warm_start=True, mask_from="sparsegpt")  # gradual by default
    with pytest.raises(ConfigError, match="tolerance"):
        Admm(tolerance=-0.1)
    Cactus(warm_start=True, mask_from="sparsegpt", gradual=False)
