"""Gradient alignment (per-window loss gradients of a model against a reference): 1.0
for a model against itself, below 1 for a perturbed copy, a hand-computed case, GPT-2's
role lookup, and the keyword of ``prunelab.evaluate``."""

from __future__ import annotations

import copy

import pytest
import torch

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.divergence import nll_sum
from prunelab.eval.gradient_alignment import gradient_alignment, matching_linears
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12, seed=5)
TEST = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="test",
                    total_windows=4, sha256="0")


def tiny(arch="llama", seed=0):
    return wrap(tiny_model(arch, seed=seed), char_tokenizer(), spec=f"tiny-{arch}")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_a_model_is_aligned_with_itself(arch):
    lm = tiny(arch)
    out = gradient_alignment(lm, lm, IDS, batch_size=3)
    assert out["gradient_alignment"] == pytest.approx(1.0, abs=1e-6)
    assert out["gradient_windows"] == 4
    assert set(out["gradient_alignment_per_block"]) == set(range(lm.adapter.num_blocks))
    assert all(v == pytest.approx(1.0, abs=1e-6)
               for v in out["gradient_alignment_per_block"].values())
    assert all(not p.requires_grad or p.grad is None for p in lm.model.parameters())


def test_a_perturbed_model_is_less_aligned_and_matches_a_hand_computation():
    lm = tiny()
    other = copy.deepcopy(lm)
    with torch.no_grad():
        for m in other.adapter.linears(0).values():
            m.weight.mul_(torch.rand(m.weight.shape, generator=torch.Generator().manual_seed(1)))
    out = gradient_alignment(other, lm, IDS, batch_size=2)
    assert out["gradient_alignment"] < 0.999
    # by hand: window 0, block 1's down_proj, full autograd on each model
    grads = []
    for model in (other, lm):
        w = model.adapter.linears(1)["mlp.down_proj"].weight
        logits = model.model(input_ids=IDS[:1], use_cache=False).logits
        (g,) = torch.autograd.grad(nll_sum(logits, IDS[:1]), w)
        grads.append(g.reshape(-1).double())
    hand0 = float(grads[0] @ grads[1] / grads[0].norm() / grads[1].norm())
    one = gradient_alignment(other, lm, IDS[:1], batch_size=1)
    assert one["gradient_alignment_per_block"][1] == pytest.approx(hand0, abs=1e-5)


def test_params_select_by_path_glob_and_role():
    lm = tiny("gpt2")
    down = matching_linears(lm, "down_proj")
    assert all(list(s) == ["mlp.c_proj"] for s in down)
    llama = tiny("llama")
    assert [list(s) for s in matching_linears(llama, "self_attn.*_proj")][0] == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    with pytest.raises(ConfigError, match="no linear matches"):
        matching_linears(llama, "nothing")
    with pytest.raises(UnsupportedOperationError, match="LM head"):
        gradient_alignment(tiny("bert"), tiny("bert"), IDS, batch_size=2)


def test_evaluate_reports_gradient_alignment():
    lm = tiny()
    other = copy.deepcopy(lm)
    with torch.no_grad():
        other.adapter.linears(1)["mlp.down_proj"].weight.mul_(0.5)
    out = prunelab.evaluate(other, TEST, gradient_reference=lm, batch_size=2)
    assert 0 < out["gradient_alignment"] < 0.9999
    assert out["gradient_reference"] == lm.spec
    assert prunelab.evaluate(lm, TEST, gradient_reference=lm)["gradient_alignment"] == \
        pytest.approx(1.0, abs=1e-6)
