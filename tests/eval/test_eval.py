"""Evaluator: perplexity equals an independent loop; KL and top-1 on hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch

from prunelab.eval.divergence import kl_from_logits, nll_sum, top1_agreement
from prunelab.eval.perplexity import score_windows
from prunelab.eval.speed import measure_speed
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens


def straightforward_ppl(model, ids):
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ids:
            logits = model(input_ids=row[None]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1].double(), row[1:],
                                                     reduction="sum")
            total += loss.item()
            count += len(row) - 1
    return math.exp(total / count)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "opt", "gpt_neox"])
def test_perplexity_equals_straightforward_loop(arch):
    model = tiny_model(arch)
    if arch == "gemma2":
        model.config.final_logit_softcapping = 0.5  # make the soft-cap bite
    ids = tiny_tokens(5, 16)
    res = score_windows(wrap(model), ids, batch_size=2)
    assert res["tokens"] == 5 * 15 and res["samples"] == 5 and res["seqlen"] == 16
    assert res["perplexity"] == pytest.approx(straightforward_ppl(model, ids), rel=1e-5)


def test_kl_and_top1_hand_computed():
    ref = torch.log(torch.tensor([[0.5, 0.5, 1e-30], [0.7, 0.2, 0.1]]))
    other = torch.log(torch.tensor([[0.25, 0.75, 1e-30], [0.1, 0.2, 0.7]]))
    kl = kl_from_logits(ref, other)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel=1e-5)
    expected1 = 0.7 * math.log(7) + 0.2 * 0 + 0.1 * math.log(1 / 7)
    assert kl[1].item() == pytest.approx(expected1, rel=1e-5)
    assert top1_agreement(ref, other).tolist() == [0.0, 0.0]
    assert top1_agreement(ref, ref).tolist() == [1.0, 1.0]
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1.0, 1e-9, 1e-9]]]))
    assert nll_sum(logits, torch.tensor([[0, 1, 2]])).item() == pytest.approx(
        -math.log(0.25) - math.log(0.1), rel=1e-6)


def test_kl_to_itself_is_zero_and_to_other_model_matches_manual():
    a, b = wrap(tiny_model("llama", seed=0)), wrap(tiny_model("llama", seed=1))
    ids = tiny_tokens(3, 10)
    same = score_windows(a, ids, batch_size=2, reference=a)
    assert same["kl_to_reference"] == pytest.approx(0.0, abs=1e-7)
    assert same["top1_agreement"] == 1.0
    diff = score_windows(a, ids, batch_size=2, reference=b)
    with torch.no_grad():
        la, lb = a.model(input_ids=ids).logits, b.model(input_ids=ids).logits
    assert diff["kl_to_reference"] == pytest.approx(kl_from_logits(lb, la).mean().item(),
                                                    rel=1e-5)
    assert diff["top1_agreement"] == pytest.approx(top1_agreement(lb, la).mean().item())
    assert diff["kl_to_reference"] > 1e-4


def test_speed_fields():
    res = measure_speed(wrap(tiny_model("llama")), prompt_len=16, decode_tokens=4, repeats=1)
    assert res["prefill_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert res["peak_memory_bytes"] > 10_000_000  # a process RSS, never zero
