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


def test_speed_against_dense_takes_ratios_within_rounds(monkeypatch):
    """Rounds alternate the dense model and the pruned one; each ratio compares the two
    measurements of one round (hand-made figures: a machine slowing down by 2x across
    rounds leaves the ratio 2.0, while the raw speeds halve)."""
    import prunelab.eval.speed as sp

    calls = []
    figures = {"dense": [(100.0, 10.0), (50.0, 5.0), (25.0, 2.5)],
               "pruned": [(200.0, 20.0), (100.0, 10.0), (50.0, 7.5)]}

    def fake(lm, **kw):
        calls.append(lm)
        pre, dec = figures[lm][sum(c == lm for c in calls) - 1]
        return {"prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
                "peak_memory_bytes": len(calls)}

    monkeypatch.setattr(sp, "measure_speed", fake)
    got = sp.speed_against("pruned", "dense", rounds=3)
    assert calls == ["dense", "pruned"] * 3
    assert got["prefill_x_dense"] == 2.0 and got["prefill_x_dense_min"] == 2.0
    assert got["prefill_tokens_per_s"] == 100.0  # median of 200, 100, 50
    # decode ratios 2, 2, 3: median 2, range 2-3, wider than 20 % of 2: noisy
    assert (got["decode_x_dense"], got["decode_x_dense_min"], got["decode_x_dense_max"]) == (
        2.0, 2.0, 3.0)
    assert got["speed_noisy"] is True and got["speed_rounds"] == 3
    assert got["decode_x_dense_noisy"] is True and got["prefill_x_dense_noisy"] is False
    assert got["peak_memory_bytes"] == 6  # the largest of the pruned model's measurements
    figures["pruned"][2] = (50.0, 5.0)
    calls.clear()
    assert sp.speed_against("pruned", "dense", rounds=3)["speed_noisy"] is False


def test_leaderboard_shows_ratios_and_drops_empty_columns():
    from prunelab.workflow.leaderboard import csv_text, display_rows, markdown

    rows = [{"method": "dense", "params": 1000, "perplexity": 10.123456,
             "prefill_tokens_per_s": 100.0},
            {"method": "w", "params": 800, "perplexity": 11.0, "prefill_tokens_per_s": 150.0,
             "prefill_x_dense": 1.5, "prefill_x_dense_min": 1.4, "prefill_x_dense_max": 1.8,
             "prefill_x_dense_noisy": True, "decode_x_dense": 1.1, "decode_x_dense_min": 1.1,
             "decode_x_dense_max": 1.15, "decode_x_dense_noisy": False, "speed_noisy": True}]
    shown = display_rows(rows, dense=rows[0])
    assert list(shown[0]) == ["method", "params", "params_kept", "perplexity",
                              "prefill_tok_s", "prefill_x_dense", "decode_x_dense"]
    assert shown[0]["perplexity"] == "10.123" and shown[1]["params_kept"] == "0.800"
    assert shown[1]["prefill_x_dense"] == "1.50 [1.40-1.80] noisy"
    assert shown[1]["decode_x_dense"] == "1.10 [1.10-1.15]"  # its own range is tight
    assert shown[0]["prefill_x_dense"] == ""
    md = markdown(rows, dense=rows[0])
    assert "achieved" not in md and "noisy: a range wider than 20 %" in md
    assert "achieved" in csv_text(rows, dense=rows[0]).splitlines()[0]  # CSV keeps all


def test_leaderboard_shows_a_press_row_on_its_continuation():
    """Under a press the continuation's figures get their own columns beside the whole
    window's; a study without a press does not show them."""
    from prunelab.workflow.leaderboard import csv_text, display_rows

    plain = [{"method": "dense", "params": 1000, "perplexity": 10.0}]
    assert "continuation_kl" not in display_rows(plain)[0]
    assert "continuation_kl" in csv_text(plain).splitlines()[0]
    rows = plain + [{"method": "snapkv", "params": 1000, "perplexity": 10.1,
                     "kl_to_reference": 0.00026, "continuation_perplexity": 11.825,
                     "continuation_kl_to_reference": 0.00441,
                     "continuation_top1_agreement": 0.961}]
    shown = display_rows(rows)
    assert list(shown[1])[-3:] == ["continuation_perplexity", "continuation_kl",
                                   "continuation_top1"]
    assert shown[1]["continuation_kl"] == "0.0044" and shown[1]["kl_to_dense"] == "0.0003"
    assert shown[1]["continuation_perplexity"] == "11.825" and shown[0]["continuation_kl"] == ""
