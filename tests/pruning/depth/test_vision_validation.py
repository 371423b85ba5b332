"""The ``validation`` depth strategy with closed-form recovery in the loop, and its
``prune depth`` flags, on tiny random DINOv2 models."""

from __future__ import annotations

import copy
import json

import pytest

import prunelab
from prunelab.data.images import images_for
from prunelab.errors import ConfigError
from prunelab.eval.task_metric import make_task_metric
from prunelab.models.loading import wrap
from prunelab.pruning import Depth
from prunelab.pruning.depth.strategies import Validation
from prunelab.pruning.depth.strategies.validation import blocks_removed
from tiny_media import SIZE, tiny_vision

# the metric scores the very windows the recovery is fitted on
OPTS = ("data=images:calib", "samples=4", f"size={SIZE}")


def _calib():
    return images_for("images:calib", samples=4, size=SIZE)


def _per_block(dense):
    """Per single block: (raw, repaired) embed-cos on the calibration windows; repaired =
    the model pruned with foldable recovery fitted on the same windows (None: block 0)."""
    lm = wrap(dense)
    metric = make_task_metric("embed-cos", lm, data="images:calib", samples=4, size=SIZE)
    out = []
    for b in range(dense.config.num_hidden_layers):
        with blocks_removed(lm, (b,)):
            raw = metric(lm)
        rep = None
        if b > 0:  # foldable needs a kept block before the cut
            one = wrap(copy.deepcopy(dense))
            prunelab.prune(one, Depth(blocks=(b,), recovery="foldable"), _calib(),
                           batch_size=2)
            rep = metric(one)
        out.append((raw, rep))
    return metric, out


def test_in_loop_scores_are_the_recovered_ones_and_the_pick_is_their_argmax():
    dense = tiny_vision(seed=3)
    metric, per = _per_block(dense)
    # on the windows it is fitted on, the repair improves every repairable candidate
    assert all(rep > raw for raw, rep in per if rep is not None)
    best = [max(raw, rep if rep is not None else raw) for raw, rep in per]
    lm = wrap(copy.deepcopy(dense))
    rep = prunelab.prune(lm, Depth(remove=1, select=Validation(metric="embed-cos",
                                                               options=OPTS),
                                   recovery="foldable", recovery_in_loop=True,
                                   bootstrap=0), _calib(), batch_size=2)
    sel = rep["selection"]
    want = max(range(len(best)), key=lambda b: best[b])
    assert rep["removed_blocks"] == [want] and sel["recovery_in_loop"]
    assert sel["value"] == pytest.approx(best[want], abs=1e-9)
    assert sel["steps"][0]["values_without_recovery"][0] == pytest.approx(per[want][0])
    assert sel["repaired"] and sel["repair_spans"] == [[want, want + 1]]
    # the applied model is the one the search scored
    assert metric(lm) == pytest.approx(sel["value"], abs=1e-9)


def test_in_loop_beats_or_ties_the_raw_search_on_its_own_metric():
    dense = tiny_vision(seed=3, layers=5)
    kw = {"select": Validation(metric="embed-cos", options=OPTS), "bootstrap": 0,
          "recovery": "foldable"}
    raw = prunelab.prune(wrap(copy.deepcopy(dense)), Depth(remove=2, **kw), _calib(),
                         batch_size=2)
    lm = wrap(copy.deepcopy(dense))
    loop = prunelab.prune(lm, Depth(remove=2, recovery_in_loop=True, **kw), _calib(),
                          batch_size=2)
    steps = loop["selection"]["steps"]
    for step in steps:
        assert step["values"][0] >= step["values_without_recovery"][0]
    # raw search's set, pruned and repaired, scores no better than the in-loop choice
    metric = make_task_metric("embed-cos", wrap(dense), data="images:calib", samples=4,
                              size=SIZE)
    other = wrap(copy.deepcopy(dense))
    prunelab.prune(other, Depth(blocks=tuple(raw["removed_blocks"]), recovery="foldable"),
                   _calib(), batch_size=2)
    assert metric(lm) >= metric(other) - 1e-9
    assert loop["selection"]["evaluations"] == 5 + 4


def test_in_loop_refusals():
    with pytest.raises(ConfigError, match="needs a --recovery that fits"):
        Depth(remove=1, strategy="validation", recovery_in_loop=True)
    with pytest.raises(ConfigError, match="validation, beam, sleb or iterative"):
        Depth(remove=1, strategy="one-shot", recovery="foldable", recovery_in_loop=True)


def test_cli_validation_flags_reach_the_strategy(tmp_path):
    from prunelab.cli import cli_main

    ckpt = tmp_path / "tiny"
    tiny_vision().save_pretrained(ckpt)
    out = tmp_path / "pruned"
    rc = cli_main(["prune", "depth", "--model", str(ckpt), "--budget", "remove-blocks:2",
                   "--strategy",
                   "validation", "--val-metric", "knn-agree", "--val-width", "2",
                   "--val-options", f"samples=4,size={SIZE},k=2", "--recovery", "foldable",
                   "--recovery-in-loop", "--samples", "3", "--bootstrap", "0",
                   "--out", str(out)])
    assert rc == 0
    man = json.dumps(json.loads((out / "manifest.json").read_text()))
    for piece in ('"metric": "knn-agree"', '"width": 2', '"recovery_in_loop": true',
                  '"values_without_recovery"'):
        assert piece in man
    assert cli_main(["prune", "depth", "--model", str(ckpt), "--budget", "remove-blocks:1",
                     "--val-width", "2", "--out", str(tmp_path / "x")]) == 2


def test_photo_metrics_take_a_held_out_seed():
    lm = wrap(tiny_vision())
    same = make_task_metric("embed-cos", lm, data="images:calib", samples=3, size=SIZE)
    held = make_task_metric("embed-cos", lm, data="images:calib", samples=3, size=SIZE,
                            seed=1)
    assert held(lm) == pytest.approx(1.0)
    with blocks_removed(lm, (1,)):
        a, b = same(lm), held(lm)
    assert a < 0.999 and b < 0.999 and a != b  # other photos, other score
