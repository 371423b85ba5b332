"""REP-LIE: the LoRA-gradient estimator equals the Taylor quantity it defines, units are
tracked with stability, prune-while-tuning reaches its target width physically, and the
``rep-lie`` width score drives ``prune width``."""

from __future__ import annotations

import copy

import pytest
import torch

import prunelab
from prunelab.heal import HealConfig, heal, lora_gradient_estimate, unit_importance
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap
from prunelab.pruning.width.execute import run_width
from prunelab.pruning.width.rep_lie import RepLieTracker, merged_weight, rep_lie_importances
from prunelab.pruning.width.scoring import RepLie
from prunelab.train.lora import Trainables, lora_factors

from tiny_models import tiny_model, tiny_tokens


def test_estimator_is_the_tangent_space_projection_of_the_full_gradient():
    g = torch.Generator().manual_seed(0)
    d_out, d_in, r, s = 7, 5, 2, 1.5
    a = torch.randn(r, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(d_out, r, generator=g, dtype=torch.float64)
    grad = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    est = lora_gradient_estimate(a, b, s * b.t() @ grad, s * grad @ a.t(), s)
    # independent: least squares over the tangent space {B X + Y A} in vectorised form
    basis = []
    for k in range(r * d_in):
        x = torch.zeros(r * d_in, dtype=torch.float64)
        x[k] = 1
        basis.append((b @ x.view(r, d_in)).flatten())
    for k in range(d_out * r):
        y = torch.zeros(d_out * r, dtype=torch.float64)
        y[k] = 1
        basis.append((y.view(d_out, r) @ a).flatten())
    m = torch.stack(basis, 1)
    coef = torch.linalg.lstsq(m, grad.flatten()[:, None], driver="gelsd").solution
    torch.testing.assert_close(est, (m @ coef).view(d_out, d_in), atol=1e-10, rtol=0)
    # B = 0 (LoRA's initialisation): the projection onto A's row space
    zero = torch.zeros_like(b)
    est0 = lora_gradient_estimate(a, zero, s * zero.t() @ grad, s * grad @ a.t(), s)
    pa = a.t() @ torch.linalg.inv(a @ a.t()) @ a
    torch.testing.assert_close(est0, grad @ pa, atol=1e-10, rtol=0)


def _backward_with_full_gradients(rank: int, kind: str):
    """A tiny llama with LoRA (B randomised) whose base weights also get gradients."""
    lm = wrap(tiny_model("llama"))
    tr = Trainables(lm, rank=rank, alpha=2.0 * rank, full=False, train_bridges=False, seed=0)
    layers = tr.lora_layers()
    with torch.no_grad():
        for layer in layers.values():
            lora_factors(layer)[1].normal_(0, 0.05)
    for layer in layers.values():
        layer.get_base_layer().weight.requires_grad_(True)
    ids = tiny_tokens(2, 12, seed=5)
    out = lm.model(input_ids=ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                      ids[:, 1:].reshape(-1)).backward()
    return lm, tr


def _direct(layer, project: bool) -> torch.Tensor:
    """``G W'`` elementwise from the full gradient ``G`` (projected on the tangent space
    with explicit projectors when ``project``)."""
    a, b, _ = lora_factors(layer)
    grad = weight_out_in(layer.get_base_layer()).grad.double()
    if project:
        a, b = a.detach().double(), b.detach().double()
        pa = a.t() @ torch.linalg.pinv(a @ a.t()) @ a
        pb = b @ torch.linalg.pinv(b.t() @ b) @ b.t()
        grad = pb @ grad + grad @ pa - pb @ grad @ pa
    return grad * merged_weight(layer)


def test_unit_importance_equals_the_taylor_term_from_full_gradients():
    lm, tr = _backward_with_full_gradients(rank=4, kind="ffn")
    ad = lm.adapter
    for i in (0, 3):
        got = unit_importance(ad, i, "ffn")
        mlp = ad.mlp_projections(i)
        want = (_direct(mlp["gate"], True).sum(1) + _direct(mlp["up"], True).sum(1)
                + _direct(mlp["down"], True).sum(0)).abs()
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)  # float32 gradients
        heads = unit_importance(ad, i, "heads")  # 2 KV groups of 2 query heads, hd 8
        att = ad.attn_projections(i)
        q, k, v, o = (_direct(att[r], True) for r in ("q", "k", "v", "o"))
        want = torch.stack([(q.sum(1)[g * 16:(g + 1) * 16].sum() + k.sum(1)[g * 8:(g + 1) * 8]
                             .sum() + v.sum(1)[g * 8:(g + 1) * 8].sum()
                             + o.sum(0)[g * 16:(g + 1) * 16].sum()) for g in range(2)]).abs()
        torch.testing.assert_close(heads, want, atol=1e-7, rtol=1e-4)  # float32 gradients
    tr.merge(keep=False)


def test_full_rank_lora_gives_the_exact_taylor_term():
    # rank = d_in of the attention projections (32): P_A = I, the estimate is exact
    lm, tr = _backward_with_full_gradients(rank=32, kind="heads")
    ad = lm.adapter
    for i in range(ad.num_blocks):
        att = ad.attn_projections(i)
        q, k, v, o = (_direct(att[r], False) for r in ("q", "k", "v", "o"))
        exact = torch.stack([(q.sum(1)[g * 16:(g + 1) * 16].sum()
                              + k.sum(1)[g * 8:(g + 1) * 8].sum()
                              + v.sum(1)[g * 8:(g + 1) * 8].sum()
                              + o.sum(0)[g * 16:(g + 1) * 16].sum()) for g in range(2)]).abs()
        torch.testing.assert_close(unit_importance(ad, i, "heads"), exact, atol=1e-7,
                                   rtol=1e-4)
    tr.merge(keep=False)


def test_tracker_prefers_stably_unimportant_units():
    tr = RepLieTracker("ffn")
    steps = [torch.tensor([1.0, 5.0, 0.5, 9.0]), torch.tensor([1.0, 5.0, 8.0, 9.0]),
             torch.tensor([1.0, 5.0, 0.1, 9.0])]
    tr.sums, tr.counts, tr.window = [sum(steps)], [3], [steps]
    # unit 0 has the lowest mean (1.0 < 8.6 / 3) but was the lowest in 1 of 3 steps only;
    # unit 2 in 2 of 3: with stability 0.5 the stable unit goes first
    assert tr.choose(0, 1, stability=0.5) == ([2], 0)
    assert tr.choose(0, 1, stability=0.9) == ([0], 1)  # nobody stable: by running mean
    # among the 2 lowest: unit 0 in 3 of 3 steps, unit 2 in 2 of 3, unit 1 in 1 of 3
    assert tr.choose(0, 2, stability=0.9) == ([0, 2], 1)
    assert tr.choose(0, 2, stability=0.6) == ([0, 2], 0)
    tr.on_slice(0, [1, 3])
    assert tr.sums[0].tolist() == [15.0, 27.0] and tr.window[0] == []


def test_prune_while_tuning_reaches_the_target_width_and_resumes(tmp_path):
    def run(out, stop=None):
        lm = wrap(tiny_model("llama"))
        cfg = HealConfig(steps=9, lr=5e-3, prune="rep-lie", unit="ffn", ratio=0.25,
                         prune_fraction=0.125, prune_every=3, round_to=2, eval_every=3,
                         patience=0, quiet=True, batch_size=2)
        cb = None if stop is None else (lambda info: info["step"] >= stop)
        return heal(lm, None, tiny_tokens(6, 12, seed=1), tiny_tokens(2, 12, seed=2), cfg,
                    out_dir=out, callback=cb)

    lm, rec = run(tmp_path / "a")
    ad = lm.adapter
    assert [ad.ffn_width(i) for i in range(4)] == [36] * 4  # 48 -> 42 -> 36
    assert [e["step"] for e in rec["prune"]["events"]] == [3, 6]
    assert rec["prune"]["width_after"] == [36] * 4
    assert lm.history[-2]["operation"] == "prune-width"
    assert not ad.vanilla_problems()
    _, part = run(tmp_path / "b", stop=4)  # interrupted after the first event
    assert part["steps"] == 4
    again, rec2 = run(tmp_path / "b")
    ref = lm.model.state_dict()
    for n, t in again.model.state_dict().items():
        torch.testing.assert_close(t, ref[n], atol=1e-6, rtol=0)
    assert rec2["prune"]["events"] == rec["prune"]["events"]


def test_rep_lie_width_score_prunes_the_least_important_channels():
    base = tiny_model("llama")
    ids = tiny_tokens(4, 12, seed=3)
    lm = wrap(copy.deepcopy(base))
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    means, facts = rep_lie_importances(lm, ids, "ffn", steps=3, batch_size=2)
    assert facts["steps"] == 3 and len(means) == 4 and means[0].shape == (48,)
    assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters())
    pruned = wrap(copy.deepcopy(base))
    run_width(pruned, prunelab.Width(unit="ffn", score=RepLie(steps=3), ratio=0.25,
                                     round_to=4), ids, batch_size=2)
    for i in range(4):
        kept = sorted(torch.argsort(means[i], stable=True)[12:].tolist())
        down = weight_out_in(pruned.adapter.mlp_projections(i)["down"])
        assert torch.equal(down, weight_out_in(lm.adapter.mlp_projections(i)["down"])[:, kept])


@pytest.mark.parametrize("arch", ["phi3", "gpt2"])
def test_fused_and_conv1d_projections_are_scored(arch):
    lm = wrap(tiny_model(arch))
    for kind in ("ffn", "heads"):
        means, _ = rep_lie_importances(lm, tiny_tokens(2, 12), kind, steps=2, batch_size=2)
        geo = lm.adapter.head_geometry(0)
        n = lm.adapter.ffn_width(0) if kind == "ffn" else geo.num_kv_heads
        assert means[0].shape == (n,) and bool((means[0] > 0).all())
