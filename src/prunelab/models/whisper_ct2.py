"""Whisper from a CTranslate2 ``model.bin`` to ``WhisperForConditionalGeneration``.

CTranslate2's ``WhisperSpec`` (faster-whisper's format) stores, per layer, a fused
self-attention ``[q; k; v]`` projection (its key bias is zero: Whisper's key projection has
no bias), a cross-attention query and a fused ``[k; v]`` projection, pre-norms as
``gamma``/``beta``, and the output projection as an alias of the token embeddings (tied).
:func:`convert_ct2_whisper` writes a plain transformers checkpoint (float32 weights, the
processor -- feature extractor and tokenizer from the shipped ``tokenizer.json`` -- and a
generation config for greedy transcription without timestamps) into a folder.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

from prunelab.errors import CorruptCheckpointError
from prunelab.log import info
from prunelab.models.conversion import publish_checkpoint
from prunelab.models.ct2 import CT2Model, read_ct2
from prunelab.paths import cache_dir

# CT2 name (below encoder/ or decoder/ layer_i/) -> transformers name (below layers.i.)
_NORMS = {"self_attention/layer_norm": "self_attn_layer_norm",
          "attention/layer_norm": "encoder_attn_layer_norm",
          "ffn/layer_norm": "final_layer_norm"}
_LINEARS = {"self_attention/linear_1": "self_attn.out_proj", "attention/linear_0":
            "encoder_attn.q_proj", "attention/linear_2": "encoder_attn.out_proj",
            "ffn/linear_0": "fc1", "ffn/linear_1": "fc2"}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32).copy())


def _num_layers(ct2: CT2Model, stack: str) -> int:
    idx = {int(m.group(1)) for k in ct2.variables
           if (m := re.match(rf"{stack}/layer_(\d+)/", k))}
    return max(idx) + 1 if idx else 0


def _layer_state(ct2: CT2Model, stack: str, i: int, d: int) -> dict[str, torch.Tensor]:
    """One encoder / decoder layer: fused projections split, norms renamed."""
    src, dst = f"{stack}/layer_{i}/", f"model.{stack}.layers.{i}."
    out: dict[str, torch.Tensor] = {}

    def have(n: str) -> bool:
        return (src + n + "/weight") in ct2.variables or (src + n + "/gamma") in ct2.variables

    for c, h in _NORMS.items():
        if have(c):
            out[dst + h + ".weight"] = _t(ct2.get(src + c + "/gamma"))
            out[dst + h + ".bias"] = _t(ct2.get(src + c + "/beta"))
    for c, h in _LINEARS.items():
        if have(c):
            out[dst + h + ".weight"] = _t(ct2.get(src + c + "/weight"))
            out[dst + h + ".bias"] = _t(ct2.get(src + c + "/bias"))
    w, b = ct2.get(src + "self_attention/linear_0/weight"), \
        ct2.get(src + "self_attention/linear_0/bias")
    for j, role in enumerate("qkv"):
        out[f"{dst}self_attn.{role}_proj.weight"] = _t(w[j * d:(j + 1) * d])
        if role != "k":  # CT2 stores a zero key bias; Whisper's k_proj has none
            out[f"{dst}self_attn.{role}_proj.bias"] = _t(b[j * d:(j + 1) * d])
    if have("attention/linear_1"):
        w, b = ct2.get(src + "attention/linear_1/weight"), ct2.get(src + "attention/linear_1/bias")
        out[f"{dst}encoder_attn.k_proj.weight"] = _t(w[:d])
        out[f"{dst}encoder_attn.v_proj.weight"] = _t(w[d:])
        out[f"{dst}encoder_attn.v_proj.bias"] = _t(b[d:])
    return out


def ct2_whisper_state(ct2: CT2Model) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config kwargs, state dict)`` of ``WhisperForConditionalGeneration`` for a CT2
    ``WhisperSpec`` model (weights in float32)."""
    if ct2.spec != "WhisperSpec":
        raise CorruptCheckpointError(f"CTranslate2 spec {ct2.spec!r} is not WhisperSpec")
    emb = ct2.get("decoder/embeddings/weight")
    vocab, d = emb.shape
    conv1 = ct2.get("encoder/conv1/weight")
    enc_l, dec_l = _num_layers(ct2, "encoder"), _num_layers(ct2, "decoder")
    cfg = dict(vocab_size=int(vocab), d_model=int(d), num_mel_bins=int(conv1.shape[1]),
               encoder_layers=enc_l, decoder_layers=dec_l,
               encoder_attention_heads=int(ct2.scalar("encoder/num_heads")),
               decoder_attention_heads=int(ct2.scalar("decoder/num_heads")),
               encoder_ffn_dim=int(ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
               decoder_ffn_dim=int(ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
               max_source_positions=int(ct2.get("encoder/position_encodings/encodings").shape[0]),
               max_target_positions=int(ct2.get("decoder/position_encodings/encodings").shape[0]),
               tie_word_embeddings=True)
    sd = {f"model.{s}.embed_positions.weight": _t(ct2.get(f"{s}/position_encodings/encodings"))
          for s in ("encoder", "decoder")}
    sd["model.decoder.embed_tokens.weight"] = _t(emb)
    for name in ("conv1", "conv2"):
        sd[f"model.encoder.{name}.weight"] = _t(ct2.get(f"encoder/{name}/weight"))
        sd[f"model.encoder.{name}.bias"] = _t(ct2.get(f"encoder/{name}/bias"))
    for stack in ("encoder", "decoder"):
        sd[f"model.{stack}.layer_norm.weight"] = _t(ct2.get(f"{stack}/layer_norm/gamma"))
        sd[f"model.{stack}.layer_norm.bias"] = _t(ct2.get(f"{stack}/layer_norm/beta"))
        for i in range(enc_l if stack == "encoder" else dec_l):
            sd.update(_layer_state(ct2, stack, i, d))
    return cfg, sd


def _special_ids(tokenizer_json: Path) -> dict[str, int]:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    return {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}


def whisper_generation(ids: dict[str, int], ct2_config: dict, multilingual: bool) -> dict:
    """Generation-config fields for greedy transcription without timestamps: English-only
    models (tiny.en) start ``<|startoftranscript|><|notimestamps|>``; multilingual ones
    get ``lang_to_id`` / ``task_to_id`` and default to language ``en``, task
    ``transcribe``."""
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    gen = dict(decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot,
               pad_token_id=eot, max_length=448, is_multilingual=multilingual,
               no_timestamps_token_id=ids["<|notimestamps|>"],
               suppress_tokens=list(ct2_config.get("suppress_ids", [])),
               begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [220, eot])),
               alignment_heads=ct2_config.get("alignment_heads", []))
    if multilingual:
        by_id = {v: k for k, v in ids.items()}
        gen["lang_to_id"] = {by_id[i]: i for i in ct2_config.get("lang_ids", []) if i in by_id}
        gen["task_to_id"] = {"transcribe": ids["<|transcribe|>"],
                             "translate": ids["<|translate|>"]}
        gen["language"], gen["task"] = "en", "transcribe"
    return gen


def convert_ct2_whisper(model_bin: list[Path], tokenizer_json: Path, ct2_config: Path,
                        out: Path) -> None:
    """Write ``WhisperForConditionalGeneration`` (float32, tied output projection), its
    processor and generation config into ``out`` (an existing empty folder)."""
    start = time.time()
    cfg_kw, sd = ct2_whisper_state(read_ct2(model_bin))
    ids = _special_ids(tokenizer_json)
    ct2_cfg = json.loads(ct2_config.read_text(encoding="utf-8")) if ct2_config.is_file() else {}
    multilingual = "<|en|>" in ids and cfg_kw["vocab_size"] >= 51865
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    gen = whisper_generation(ids, ct2_cfg, multilingual)
    config = tf.WhisperConfig(**cfg_kw, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
                              decoder_start_token_id=sot)
    model = tf.WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]
    if missing or unexpected:
        raise CorruptCheckpointError(f"CT2 Whisper conversion: missing {missing[:3]}, "
                                     f"unexpected {unexpected[:3]}")
    model.tie_weights()
    model.generation_config = tf.GenerationConfig(**gen)
    tok = tf.WhisperTokenizerFast(tokenizer_file=str(tokenizer_json), unk_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    fe = tf.WhisperFeatureExtractor(feature_size=cfg_kw["num_mel_bins"])
    model.save_pretrained(out)
    tf.WhisperProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(out)
    info(f"prunelab: converted CTranslate2 Whisper in {time.time() - start:.1f} s")


def ct2_whisper_once(name: str, paths: list[Path]) -> Path:
    """Convert an embedded CT2 Whisper once into ``<cache>/converted/<name>`` (temp folder
    renamed into place; a complete copy another process published is kept). ``paths``:
    the ``model.bin`` chunk(s), then ``tokenizer.json`` and the CT2 ``config.json``."""
    target = cache_dir() / "converted" / name
    if (target / "config.json").is_file():
        return target
    *bins, tok, cfg = paths
    info(f"prunelab: converting {name} from CTranslate2 into {target} (once)")
    publish_checkpoint(target, lambda tmp: convert_ct2_whisper(bins, tok, cfg, tmp))
    return target
