"""BMuon: an unlimited budget is Muon; the allocation meets the budget exactly at every
step; the surrogate and the restricted update follow the derivation."""

from __future__ import annotations

import copy

import torch

from prunelab.models.loading import wrap
from prunelab.train.bmuon import (
    BMuon,
    ChannelGroup,
    _newton_schulz,
    allocate,
    channel_surrogate,
    mlp_channel_groups,
    orthogonalise,
)

from tiny_models import tiny_model, tiny_tokens


def _blocks(seed=0, blocks=3, d=8, width=12):
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(blocks):
        params += [torch.nn.Parameter(torch.randn(width, d, generator=g)),
                   torch.nn.Parameter(torch.randn(width, d, generator=g)),
                   torch.nn.Parameter(torch.randn(d, width, generator=g))]
    groups = [ChannelGroup(params[3 * b:3 * b + 2], [params[3 * b + 2]]) for b in range(blocks)]
    return params, groups


def _at(params, p):
    return next(i for i, q in enumerate(params) if q is p)


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_unlimited_budget_is_muon_bit_for_bit():
    params, groups = _blocks()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = BMuon(params, groups, budget=10**6, lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(twins, lr=0.02, weight_decay=0.1)
    for step in range(4):
        _grads(params, step)
        _grads(twins, step)
        ours.step()
        ref.step()
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(k.all() for k in ours.keep)


def test_allocation_meets_the_budget_exactly_every_step_and_outside_channels_decay():
    params, groups = _blocks(seed=1)
    opt = BMuon(params, groups, budget=14, lr=0.05, weight_decay=0.0, outside_decay=2.0)
    for step in range(6):
        _grads(params, step)
        before = [p.detach().clone() for p in params]
        opt.step()
        assert sum(int(k.sum()) for k in opt.keep) == 14
        assert all(int(k.sum()) >= 1 for k in opt.keep)
        for b, g in enumerate(groups):  # outside: no gradient step, decay by 1 - lr * 2
            out = ~opt.keep[b]
            for p in g.rows:
                i = _at(params, p)
                torch.testing.assert_close(p[out], before[i][out] * 0.9, rtol=0, atol=1e-7)
            i = _at(params, g.cols[0])
            torch.testing.assert_close(g.cols[0][:, out], before[i][:, out] * 0.9, rtol=0,
                                       atol=1e-7)
    # the kept rows moved by the orthogonalised momentum of the kept rows only
    kept = opt.keep[0]
    assert not torch.equal(params[0][kept], before[0][kept])


def test_surrogate_and_allocation_hand_case():
    w = torch.nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))  # rows
    down = torch.nn.Parameter(torch.tensor([[1.0, 0.0, 0.0]]))
    w.grad = torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]])
    g = ChannelGroup([w], [down])
    # u_c = -<G_c, W_c> + h/2 ||W_c||^2 with h = 2: ||W_c||^2 = [1+1, 4, 2], <G,W> = [1, 1, 0]
    u = channel_surrogate(g, curvature=2.0)
    assert u.tolist() == [1.0, 3.0, 2.0]
    keep = allocate([torch.tensor([5.0, 1.0, 3.0]), torch.tensor([0.5, 0.4]),
                     torch.tensor([4.0, 2.0])], budget=5)
    assert [k.tolist() for k in keep] == [[True, False, True], [True, False], [True, True]]
    keep = allocate([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], budget=1)  # 1 per block
    assert [k.tolist() for k in keep] == [[False, True], [True]]


def test_newton_schulz_fallback_matches_torch_and_orthogonalises():
    g = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_newton_schulz(g), orthogonalise(g), rtol=0, atol=0)
    s = torch.linalg.svdvals(orthogonalise(g).float())
    assert (s > 0.5).all() and (s < 1.5).all()


def test_bmuon_trains_a_tiny_llama_under_a_budget():
    lm = wrap(tiny_model("llama"))
    groups = mlp_channel_groups(lm)
    mats = [p for n, p in lm.model.named_parameters() if p.ndim == 2 and "layers" in n]
    others = [p for n, p in lm.model.named_parameters() if not (p.ndim == 2 and "layers" in n)]
    opt = BMuon(mats, groups, budget=96, lr=0.02)
    adam = torch.optim.AdamW(others, lr=1e-3)
    ids = tiny_tokens(4, 16, seed=1)
    start = copy.deepcopy(lm.model.state_dict())
    losses = []
    for _ in range(8):
        out = lm.model(input_ids=ids, labels=ids, use_cache=False)
        opt.zero_grad()
        adam.zero_grad()
        out.loss.backward()
        opt.step()
        adam.step()
        losses.append(float(out.loss.detach()))
        assert sum(int(k.sum()) for k in opt.keep) == 96
    assert losses[-1] < losses[0]
    assert not torch.equal(start["model.layers.0.mlp.down_proj.weight"],
                           lm.model.model.layers[0].mlp.down_proj.weight)
