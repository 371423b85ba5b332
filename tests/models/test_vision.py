"""Vision encoders (DINOv2, ViT): adapters, probes, depth / width pruning and save/reload on
tiny random models; image data; the ONNX conversion on a synthetic graph; evaluation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data.images import images_for, lfw_split
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning import Depth, Width
from tiny_media import hidden, pixels, tiny_vision


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_info_and_adapter_geometry(arch):
    lm = wrap(tiny_vision(arch))
    inf = prunelab.info(lm)
    assert (inf["family"], inf["blocks"], inf["heads"], inf["head_dim"], inf["ffn"]) == \
        (arch, 4, 4, 8, 64)
    assert inf["encoder"] and lm.tokenizer is None and lm.adapter.is_vision
    # ViT's position embeddings interpolate to the photos' size; DINOv2's always do
    extra = {"interpolate_pos_encoding"} if arch == "vit" else set()
    assert set(lm.adapter.model_inputs(torch.zeros(1))) == {"pixel_values"} | extra


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_leave_one_out_equals_hand_built_deletion(arch):
    dense = tiny_vision(arch)
    data = pixels()
    res = prunelab.probe(wrap(dense), "leave-one-out", data, batch_size=4)
    for i in range(4):
        model = copy.deepcopy(dense)
        wrap(model).adapter.delete_blocks([i])
        ref, out = hidden(dense, data.input_ids), hidden(model, data.input_ids)
        want = float((1 - torch.cosine_similarity(ref.mean(1).double(), out.mean(1).double(),
                                                  dim=-1)).mean())
        assert res.scores[i]["value"] == pytest.approx(want, rel=1e-4, abs=1e-9)


def test_other_probes_run_on_pixels():
    res = prunelab.probe(wrap(tiny_vision()), "block-influence,cka", pixels(), batch_size=3)
    assert len(res["block-influence"].ranking()) == 4
    assert len(res["cka"].scores) > 0


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
@pytest.mark.parametrize("recovery", ["none", "foldable", "boundary"])
def test_depth_pruning_saves_and_reloads_identically(arch, recovery, tmp_path):
    lm = wrap(tiny_vision(arch))
    data = pixels()
    rep = prunelab.prune(lm, Depth(remove=2, probe="block-influence", recovery=recovery),
                         data, batch_size=3)
    assert len(rep["removed_blocks"]) == 2 and lm.adapter.num_blocks == 2
    if recovery != "none":
        assert rep["calib_kl_after_recovery"] < rep["calib_kl_before_recovery"]
    out = prunelab.save(lm, tmp_path / "pruned")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    again = tf.AutoModel.from_pretrained(out).eval()
    assert torch.equal(hidden(again, data.input_ids), hidden(lm.model, data.input_ids))


def test_layer_scale_folding_keeps_the_function():
    from prunelab.models.vision import fold_layer_scales

    model = tiny_vision()
    x = pixels().input_ids
    before = hidden(model, x)
    assert fold_layer_scales(wrap(model).adapter) == 8
    assert all(bool((b.layer_scale1.lambda1 == 1).all()) for b in model.encoder.layer)
    torch.testing.assert_close(hidden(model, x), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_width_pruning_heads_and_ffn_reload(arch, tmp_path):
    lm = wrap(tiny_vision(arch))
    data = pixels()
    prunelab.prune(lm, Width(unit="heads", ratio=0.5), data, batch_size=3)
    prunelab.prune(lm, Width(unit="ffn", ratio=0.5, round_to=32), data, batch_size=3)
    inf = prunelab.info(lm)
    assert inf["heads"] == 2 and inf["ffn"] == 32
    out = prunelab.save(lm, tmp_path / "w")
    again = tf.AutoModel.from_pretrained(out).eval()
    assert torch.equal(hidden(again, data.input_ids), hidden(lm.model, data.input_ids))


def test_image_specs_are_deterministic_and_disjoint():
    a = images_for("images:test", samples=3, size=28)
    b = images_for("images:test", samples=3, size=28)
    c = images_for("images:calib", samples=3, size=28)
    assert a.input_ids.shape == (3, 3, 28, 28) and a.sha256 == b.sha256
    assert torch.equal(a.input_ids, b.input_ids) and a.sha256 != c.sha256
    assert not any(torch.equal(x, y) for x in a.input_ids for y in c.input_ids)
    calib, test = lfw_split("calib"), lfw_split("test")
    assert len(calib) == len(test) == 100 and not set(calib) & set(test)
    assert (calib < 100).sum() == 50  # 50 faces + 50 non-faces each
    lfw = images_for("lfw:test", samples=4, size=28)
    assert lfw.input_ids.shape == (4, 3, 28, 28)
    with pytest.raises(ConfigError, match="images:test"):
        images_for("wiki:test")
