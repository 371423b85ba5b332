"""Vision evaluation (fidelity, kNN agreement, LFW ridge probe), task metrics and the
``validation`` depth strategy on tiny random DINOv2 models."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import prunelab
from prunelab.eval.task_metric import TASK_METRICS, make_task_metric
from prunelab.eval.vision import knn_agreement, ridge_fit_predict
from prunelab.models.loading import wrap
from prunelab.pruning import Depth
from prunelab.pruning.depth.strategies import Validation
from prunelab.pruning.depth.strategies.validation import blocks_removed
from tiny_media import hidden, pixels, tiny_vision


def _angles(*deg):
    return torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in deg])


def test_knn_agreement_hand_case():
    ref = _angles(0, 10, 50, 60)  # nearest: 0<->1, 2<->3
    out = _angles(0, 40, 50, 90)  # nearest: 0->1, 1->2, 2->1, 3->2
    assert knn_agreement(ref, ref, k=1) == 1.0
    assert knn_agreement(ref, out, k=1) == 0.5


def test_ridge_probe_separates_a_hand_case():
    x = torch.tensor([[0.0, 1.0], [1.0, 1.0], [10.0, 1.0], [11.0, 1.0]])
    y = torch.tensor([0, 0, 1, 1])
    pred = ridge_fit_predict(x, y, torch.tensor([[0.5, 1.0], [10.5, 1.0], [-3.0, 1.0]]),
                             ridge=0.01)
    assert pred.tolist() == [0, 1, 0]


def test_evaluate_vision_model_against_itself_and_pruned():
    dense = tiny_vision()
    res = prunelab.evaluate(wrap(dense), samples=5, batch_size=5)
    assert res["cls_cosine"] == pytest.approx(1.0) and res["knn_agreement"] == 1.0
    assert 0.0 <= res["lfw_accuracy"] <= 1.0 and res["images_per_s"] > 0
    assert res["data"]["spec"] == "images:test" and res["samples"] == 5
    pruned = wrap(copy.deepcopy(dense))
    pruned.adapter.delete_blocks([0, 1])
    res2 = prunelab.evaluate(pruned, samples=5, batch_size=5, reference=wrap(dense))
    assert res2["cls_cosine"] < 0.999 and res2["mean_cosine"] < 0.999
    assert res2["params"] < res["params"]


def test_task_metrics_are_registered_and_bound_to_the_dense_model():
    lm = wrap(tiny_vision())
    m = make_task_metric("embed-cos", lm, size=56, samples=4)
    assert {"embed-cos", "knn-agree", "lfw-acc"} <= set(TASK_METRICS)
    assert m(lm) == pytest.approx(1.0) and m.higher_is_better
    acc = make_task_metric("lfw-acc", lm, size=28)(lm)
    assert 0.0 <= acc <= 1.0 and round(acc * 50) == pytest.approx(acc * 50)  # 50 images


def test_blocks_removed_restores_the_model():
    lm = wrap(tiny_vision())
    x = pixels(2).input_ids
    before = hidden(lm.model, x)
    with blocks_removed(lm, (1, 2)):
        assert lm.adapter.num_blocks == 2 and lm.model.config.num_hidden_layers == 2
        assert not torch.equal(hidden(lm.model, x), before)
    assert lm.adapter.num_blocks == 4 and lm.model.config.num_hidden_layers == 4
    assert torch.equal(hidden(lm.model, x), before)


def test_validation_greedy_picks_the_best_single_block_and_beam_is_no_worse():
    dense = tiny_vision()
    lm = wrap(dense)
    metric = make_task_metric("embed-cos", lm, size=56, samples=4)
    singles = []
    for b in range(4):
        with blocks_removed(lm, (b,)):
            singles.append(metric(lm))
    opts = ("size=56", "samples=4")
    one = wrap(copy.deepcopy(dense))
    rep = prunelab.prune(one, Depth(remove=1, select=Validation(metric="embed-cos",
                                                                options=opts),
                                    bootstrap=0), pixels(), batch_size=3)
    assert rep["removed_blocks"] == [max(range(4), key=lambda b: singles[b])]
    assert rep["selection"]["value"] == pytest.approx(max(singles))
    greedy = prunelab.prune(wrap(copy.deepcopy(dense)), Depth(
        remove=2, select=Validation(metric="embed-cos", options=opts), bootstrap=0),
        pixels(), batch_size=3)
    beam = prunelab.prune(wrap(copy.deepcopy(dense)), Depth(
        remove=2, select=Validation(metric="embed-cos", width=3, options=opts),
        bootstrap=0), pixels(), batch_size=3)
    assert beam["selection"]["value"] >= greedy["selection"]["value"] - 1e-12
    assert beam["selection"]["evaluations"] > greedy["selection"]["evaluations"] == 4 + 3


def test_validation_rejects_bad_options():
    with pytest.raises(prunelab.errors.ConfigError, match="width"):
        Validation(width=0)
    with pytest.raises(prunelab.errors.ConfigError, match="KEY=VALUE"):
        Validation(options=("size",))
    with pytest.raises(prunelab.errors.ConfigError, match="unknown task metric"):
        prunelab.prune(wrap(tiny_vision()), Depth(remove=1, select=Validation(
            metric="nope"), bootstrap=0), pixels(), batch_size=3)


def test_validation_config_round_trips_through_json():
    import json

    from prunelab.pruning.base import METHODS
    from prunelab.registry import to_dict

    cfg = Depth(remove=2, select=Validation(metric="lfw-acc", width=2, options=("size=56",)),
                recovery="foldable")
    again = METHODS.from_dict(json.loads(json.dumps(to_dict(cfg))))
    assert again == cfg and again.select.options == ("size=56",)
    assert Validation(options="size=56,samples=4").options == ("size=56", "samples=4")


def test_images_per_second_clocks():
    from prunelab.eval.vision import images_per_second

    model = tiny_vision()
    assert images_per_second(model, 28, 2, 1, clock="cpu") > 0
    with pytest.raises(ValueError, match="clock"):
        images_per_second(model, 28, 2, 1, clock="gpu")


def test_validation_on_a_causal_lm_uses_perplexity():
    from prunelab.data import TokenBatches
    from prunelab.eval.perplexity import score_windows

    from tiny_models import char_tokenizer, tiny_model, tiny_tokens

    ids = tiny_tokens(4, 12)
    calib = TokenBatches(input_ids=ids, spec="tiny", seqlen=12, samples=4, seed=0,
                         mode="calib", total_windows=4, sha256="0")
    dense = tiny_model("llama")
    lm = wrap(dense, char_tokenizer())
    ppl = []
    for b in range(4):
        with blocks_removed(lm, (b,)):
            ppl.append(score_windows(lm, ids, batch_size=8)["perplexity"])
    pruned = wrap(copy.deepcopy(dense), char_tokenizer())
    rep = prunelab.prune(pruned, Depth(remove=1, strategy="validation", bootstrap=0), calib,
                         batch_size=2)
    assert rep["removed_blocks"] == [min(range(4), key=lambda b: ppl[b])]
    assert rep["selection"]["metric"] == "perplexity"
    assert rep["selection"]["value"] == pytest.approx(min(ppl), rel=1e-6)
