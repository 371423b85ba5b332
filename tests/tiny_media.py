"""Tiny random vision and speech models and their inputs, shared by the tests of several
folders (DINOv2 / ViT encoders, Whisper with its CTranslate2 layout)."""

from __future__ import annotations

import struct

import numpy as np
import torch
import transformers as tf

from prunelab.data.images import ImageBatches

SIZE = 56  # 4 x 4 patches of 14 + CLS = 17 tokens


def tiny_vision(arch: str = "dinov2", seed: int = 0, layers: int = 4):
    torch.manual_seed(seed)
    if arch == "dinov2":
        cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                              mlp_ratio=2, image_size=SIZE, patch_size=14)
        model = tf.Dinov2Model(cfg)
        for blk in model.encoder.layer:  # non-trivial LayerScale, as in trained DINOv2
            blk.layer_scale1.lambda1.data.uniform_(0.2, 1.5)
            blk.layer_scale2.lambda1.data.uniform_(0.2, 1.5)
    else:
        cfg = tf.ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=64, image_size=SIZE, patch_size=14)
        model = tf.ViTModel(cfg, add_pooling_layer=False)
    return model.eval()


def pixels(n: int = 6, seed: int = 1) -> ImageBatches:
    x = torch.randn(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))
    return ImageBatches(input_ids=x, spec="random", size=SIZE, samples=n, seed=seed,
                        mode="calib", sha256="0")


def hidden(model, x):
    with torch.no_grad():
        return model(pixel_values=x).last_hidden_state


def write_ct2(variables: dict, aliases: dict, spec: str = "WhisperSpec",
              version: int = 6) -> bytes:
    """Bytes of a model.bin in CTranslate2's documented layout (see prunelab.models.ct2).
    A variable is a numpy array or ``(dims, dtype id, raw bytes)``."""
    out = struct.pack("<I", version) + _string(spec) + struct.pack("<I", 3)
    out += struct.pack("<I", len(variables))
    for name, arr in variables.items():
        if isinstance(arr, tuple):
            dims, dtype_id, raw = arr
        else:
            arr = np.ascontiguousarray(arr)
            dims, dtype_id, raw = arr.shape, _IDS[arr.dtype.name], arr.tobytes()
        out += _string(name) + struct.pack("<B", len(dims))
        out += b"".join(struct.pack("<I", d) for d in dims)
        out += struct.pack("<B", dtype_id) + struct.pack("<I", len(raw)) + raw
    out += struct.pack("<I", len(aliases))
    for a, t in aliases.items():
        out += _string(a) + _string(t)
    return out


# ------------------------------------------------------------------ a tiny Whisper
def tiny_whisper(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tf.WhisperConfig(vocab_size=64, d_model=16, encoder_layers=layers,
                           decoder_layers=layers, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           num_mel_bins=8, max_source_positions=1500, max_target_positions=32,
                           pad_token_id=1, bos_token_id=1, eos_token_id=1,
                           decoder_start_token_id=2)
    model = tf.WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random biases so that a swapped or dropped bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def ct2_variables(model) -> dict[str, np.ndarray]:
    """The model's weights in CT2 WhisperSpec naming: fused q/k/v (zero key bias),
    fused cross-attention k/v, gamma/beta norms."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    v, d = {}, model.config.d_model
    for stack in ("encoder", "decoder"):
        p = f"model.{stack}."
        v[f"{stack}/layer_norm/gamma"] = sd[p + "layer_norm.weight"]
        v[f"{stack}/layer_norm/beta"] = sd[p + "layer_norm.bias"]
        v[f"{stack}/position_encodings/encodings"] = sd[p + "embed_positions.weight"]
        v[f"{stack}/num_heads"] = np.array(2, np.int16)
        n = model.config.encoder_layers if stack == "encoder" else model.config.decoder_layers
        for i in range(n):
            s, c = f"{p}layers.{i}.", f"{stack}/layer_{i}/"
            v[c + "self_attention/linear_0/weight"] = np.concatenate(
                [sd[s + f"self_attn.{r}_proj.weight"] for r in "qkv"])
            v[c + "self_attention/linear_0/bias"] = np.concatenate(
                [sd[s + "self_attn.q_proj.bias"], np.zeros(d, np.float32),
                 sd[s + "self_attn.v_proj.bias"]])
            mapping = {"self_attention/linear_1": "self_attn.out_proj", "ffn/linear_0": "fc1",
                       "ffn/linear_1": "fc2", "self_attention/layer_norm":
                       "self_attn_layer_norm", "ffn/layer_norm": "final_layer_norm"}
            if stack == "decoder":
                mapping.update({"attention/linear_0": "encoder_attn.q_proj",
                                "attention/linear_2": "encoder_attn.out_proj",
                                "attention/layer_norm": "encoder_attn_layer_norm"})
                v[c + "attention/linear_1/weight"] = np.concatenate(
                    [sd[s + "encoder_attn.k_proj.weight"], sd[s + "encoder_attn.v_proj.weight"]])
                v[c + "attention/linear_1/bias"] = np.concatenate(
                    [np.zeros(d, np.float32), sd[s + "encoder_attn.v_proj.bias"]])
            for ck, hk in mapping.items():
                if ck.endswith("layer_norm"):
                    v[c + ck + "/gamma"] = sd[s + hk + ".weight"]
                    v[c + ck + "/beta"] = sd[s + hk + ".bias"]
                else:
                    v[c + ck + "/weight"] = sd[s + hk + ".weight"]
                    v[c + ck + "/bias"] = sd[s + hk + ".bias"]
    for name in ("conv1", "conv2"):
        v[f"encoder/{name}/weight"] = sd[f"model.encoder.{name}.weight"]
        v[f"encoder/{name}/bias"] = sd[f"model.encoder.{name}.bias"]
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return v


# ------------------------------------------------------------------ a CT2 writer (layout)
_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<H", len(raw) + 1) + raw + b"\0"
