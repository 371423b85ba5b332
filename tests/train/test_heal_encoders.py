"""Healing of pruned encoders by feature distillation (prunelab.train.encoders and
`prunelab heal` on vision / speech models) on tiny DINOv2 / ViT / Whisper models."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.train.encoders import EncoderHealConfig, final_loss, heal_encoder
from tiny_media import SIZE, hidden, pixels, tiny_vision, tiny_whisper


def _depth_pruned(dense_lm, blocks, noise: float = 0.0):
    """A deep copy of ``dense_lm`` with ``blocks`` deleted and the depth record a pruned
    checkpoint's manifest would hold; ``noise``: seeded noise added to the kept blocks'
    linears, so the distillation has a clear gap to close."""
    lm = copy.deepcopy(dense_lm)
    lm.adapter.delete_blocks(list(blocks))
    lm.history = [{"operation": "prune-depth", "removed_blocks": list(blocks)}]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in range(lm.adapter.num_blocks):
            for m in lm.adapter.linears(i).values():
                m.weight.add_(torch.randn(m.weight.shape, generator=gen) * noise)
    return lm


def _shapes(model) -> dict:
    return {n: tuple(p.shape) for n, p in model.state_dict().items()}


def test_final_losses_on_hand_computed_values():
    s = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    t = torch.tensor([[[1.0, 1.0], [0.0, 1.0]]])
    # squared differences 0, 1, 0, 1 -> mean 0.5; cosines 1/sqrt(2) and 1 -> 1 - mean
    assert float(final_loss(s, t, "mse")) == pytest.approx(0.5)
    assert float(final_loss(s, t, "cosine")) == pytest.approx(1 - (2 ** -0.5 + 1) / 2)


@pytest.mark.parametrize("arch,loss", [("dinov2", "mse"), ("vit", "cosine")])
def test_distillation_lowers_the_loss_and_keeps_the_structure(arch, loss):
    dense = wrap(tiny_vision(arch))
    lm = _depth_pruned(dense, [1], noise=0.3)
    x = pixels(4).input_ids
    shapes = _shapes(lm.model)
    teacher = {n: p.clone() for n, p in dense.model.state_dict().items()}
    cfg = EncoderHealConfig(loss=loss, hidden_weight=1.0, steps=10, lr=1e-2, batch_size=4,
                            eval_every=5, patience=0, quiet=True)
    _, rec = heal_encoder(lm, dense, x, x, cfg)  # held-out = the fixed training batch
    before, after = rec["held_out"]["before"], rec["held_out"]["after"]
    assert after["loss"] < 0.7 * before["loss"]
    assert after["token_cosine"] > before["token_cosine"]
    assert rec["boundaries"] == [[1, 2], [2, 3]]  # student blocks 1, 2 <- dense 2, 3
    assert rec["steps"] == 10 and rec["mode"] == "lora" and rec["num_blocks"] == 3
    assert _shapes(lm.model) == shapes  # merged: no peft module, same shapes
    assert lm.history[-1]["operation"] == "heal" and lm.history[0]["removed_blocks"] == [1]
    assert all(torch.equal(teacher[n], p) for n, p in dense.model.state_dict().items())


def test_early_stopping_restores_the_best_state():
    dense = wrap(tiny_vision())
    lm = _depth_pruned(dense, [2])
    x = pixels(4).input_ids
    cfg = EncoderHealConfig(steps=6, lr=5.0, full=True, max_grad_norm=0, batch_size=4,
                            eval_every=1, patience=2, quiet=True)  # lr 5 diverges
    _, rec = heal_encoder(lm, dense, x, x, cfg)
    history = rec["held_out"]["history"]
    best = min(history, key=lambda e: e["loss"])
    assert rec["early_stopped"] and rec["steps"] < 6
    assert rec["best_step"] == best["step"]
    assert rec["held_out"]["after"]["loss"] == pytest.approx(best["loss"], rel=1e-5)


def test_whisper_encoder_distillation_trains_only_the_encoder():
    teacher = wrap(tiny_whisper(layers=3), spec="tiny-whisper")
    lm = _depth_pruned(teacher, [1])
    feats = torch.randn(2, 8, 3000, generator=torch.Generator().manual_seed(0))
    decoder = {n: p.clone() for n, p in lm.model.model.decoder.state_dict().items()}
    cfg = EncoderHealConfig(steps=4, lr=3e-2, batch_size=2, hidden_weight=0.5,
                            eval_every=0, patience=0, full=True, quiet=True)
    _, rec = heal_encoder(lm, teacher, feats, feats, cfg)
    assert rec["modality"] == "speech" and rec["boundaries"] == [[1, 2]]
    assert rec["held_out"]["after"]["loss"] < rec["held_out"]["before"]["loss"]
    assert lm.model.config.encoder_layers == 2 and lm.model.config.decoder_layers == 3
    assert all(torch.equal(decoder[n], p) for n, p in
               lm.model.model.decoder.state_dict().items())


def test_config_and_pair_errors():
    with pytest.raises(ConfigError, match="encoder loss must be one of mse, cosine"):
        EncoderHealConfig(loss="kd")
    with pytest.raises(ConfigError, match="steps"):
        EncoderHealConfig(steps=0)
    dense = wrap(tiny_vision())
    x = pixels(2).input_ids
    bare = copy.deepcopy(dense)
    bare.adapter.delete_blocks([0])  # no depth record
    with pytest.raises(ConfigError, match="no depth record"):
        heal_encoder(bare, dense, x, None, EncoderHealConfig(hidden_weight=1.0, patience=0))
    with pytest.raises(ConfigError, match="give --teacher"):
        heal_encoder(bare, None, x, None, EncoderHealConfig(patience=0))
    with pytest.raises(ConfigError, match="needs held-out data"):
        heal_encoder(bare, dense, x, None, EncoderHealConfig())
    with pytest.raises(ConfigError, match="family"):
        heal_encoder(bare, wrap(tiny_vision("vit")), x, None, EncoderHealConfig(patience=0))


# ------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory):
    """A tiny DINOv2 checkpoint and a copy with block 1 removed (saved with its manifest)."""
    root = tmp_path_factory.mktemp("heal_enc")
    dense = wrap(tiny_vision())
    prunelab.save(dense, root / "dense")
    lm = copy.deepcopy(dense)
    prunelab.prune(lm, prunelab.pruning.Depth(blocks=(1,)), pixels(4), batch_size=2)
    prunelab.save(lm, root / "pruned")
    return root


def _cli(capsys, *args) -> tuple[int, str, str]:
    from prunelab.cli import cli_main

    code = cli_main(["--quiet", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_heals_a_depth_pruned_vit_and_the_checkpoint_reloads(vision_dirs, capsys):
    root = vision_dirs
    code, out, err = _cli(capsys, "heal", "--model", str(root / "pruned"), "--teacher",
                          str(root / "dense"), "--image-size", str(SIZE), "--steps", "3",
                          "--train-samples", "4", "--eval-samples", "2", "--batch-size",
                          "2", "--eval-every", "1", "--lr", "1e-3", "--hidden-weight", "1",
                          "--out", str(root / "healed"))
    assert code == 0, err
    assert "held-out CLS cosine before -> after" in out
    man = json.loads((root / "healed" / "manifest.json").read_text())
    rec = man["healing"]
    assert rec["steps"] == 3 and rec["boundaries"] == [[1, 2], [2, 3]]
    assert rec["data"]["train"]["spec"] == "images:calib" and rec["image_size"] == SIZE
    assert rec["data"]["eval"]["spec"] == "images:test"
    assert [op["operation"] for op in man["operations"]] == ["prune-depth", "heal"]
    assert man["metrics"]["held_out_after_loss"] == rec["held_out"]["after"]["loss"]
    healed = tf.AutoModel.from_pretrained(root / "healed").eval()
    pruned = tf.AutoModel.from_pretrained(root / "pruned").eval()
    assert healed.config.num_hidden_layers == 3 and _shapes(healed) == _shapes(pruned)
    x = pixels(2).input_ids
    assert not torch.equal(hidden(healed, x), hidden(pruned, x))  # the weights moved
    # reload identical: prunelab's loader gives the same outputs as plain transformers
    again = prunelab.load(str(root / "healed"))
    assert torch.equal(hidden(again.model, x), hidden(healed, x))


def test_cli_heals_a_whisper_encoder_on_a_folder_of_clips(tmp_path, capsys):
    from scipy.io import wavfile

    dense = wrap(tiny_whisper(layers=3), spec="tiny-whisper")
    prunelab.save(dense, tmp_path / "dense")
    lm = copy.deepcopy(dense)
    lm.adapter.delete_blocks([2])
    lm.history = [{"operation": "prune-depth", "removed_blocks": [2]}]
    prunelab.save(lm, tmp_path / "pruned")
    rng = np.random.default_rng(0)
    for split in ("train", "held"):
        (tmp_path / split).mkdir()
        for i in range(2):
            wavfile.write(tmp_path / split / f"c{i}.wav", 16000,
                          rng.normal(0, 2000, 8000).astype(np.int16))
            (tmp_path / split / f"c{i}.txt").write_text(f"clip {i}")
    code, out, err = _cli(capsys, "heal", "--model", str(tmp_path / "pruned"), "--teacher",
                          str(tmp_path / "dense"), "--data", str(tmp_path / "train"),
                          "--eval-data", str(tmp_path / "held"), "--steps", "2", "--full",
                          "--lr", "1e-3", "--eval-every", "0", "--out", str(tmp_path / "h"))
    assert code == 0, err
    rec = json.loads((tmp_path / "h" / "manifest.json").read_text())["healing"]
    assert rec["modality"] == "speech" and rec["mode"] == "full" and rec["steps"] == 2
    assert rec["data"]["train"]["clips"] == 1 and rec["data"]["eval"]["sentences"] == 2
    back = tf.WhisperForConditionalGeneration.from_pretrained(tmp_path / "h")
    assert (back.config.encoder_layers, back.config.decoder_layers) == (2, 3)


@pytest.mark.parametrize("extra,message", [
    (["--tokens", "100"], "--tokens (use --steps) apply to text models only"),
    (["--seqlen", "16", "--prune", "rep-lie"], "--seqlen, --prune apply to text models"),
    (["--loss", "kd"], "encoder loss must be one of mse, cosine"),
    (["--steps", "0"], "steps"),
    (["--image-size", "0"], "--image-size must be in [14, 4096], got 0"),
    (["--image-size", "-5"], "--image-size must be in [14, 4096], got -5"),
    (["--train-samples", "0"], "--train-samples must be in [1, inf], got 0"),
    (["--eval-samples", "0"], "--eval-samples must be in [1, inf], got 0"),
])
def test_cli_encoder_errors_are_one_line(vision_dirs, capsys, extra, message):
    code, _, err = _cli(capsys, "heal", "--model", str(vision_dirs / "pruned"), "--teacher",
                        str(vision_dirs / "dense"), *extra, "--out",
                        str(vision_dirs / "never"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]
    assert not (vision_dirs / "never").exists()


def test_cli_needs_a_teacher_and_image_size_is_vision_only(vision_dirs, tmp_path, capsys):
    from tiny_models import save_tiny_checkpoint

    code, _, err = _cli(capsys, "heal", "--model", str(vision_dirs / "pruned"), "--out",
                        str(tmp_path / "x"))
    assert code == 2 and "give --teacher" in err and len(err.strip().splitlines()) == 1
    save_tiny_checkpoint("llama", tmp_path / "text")
    code, _, err = _cli(capsys, "heal", "--model", str(tmp_path / "text"), "--image-size",
                        "56", "--out", str(tmp_path / "y"))
    assert code == 2 and "--image-size applies to vision encoders only" in err


def test_peek_modality(vision_dirs, tmp_path):
    from prunelab.api.heal_encoders import peek_modality

    from tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("gpt2", tmp_path / "text")
    assert peek_modality(str(vision_dirs / "dense")) == "vision"
    assert peek_modality(str(tmp_path / "text")) is None
    assert peek_modality("dinov2-small") == "vision"
    assert peek_modality("whisper-tiny-en") == "speech"
    assert peek_modality("smollm2-135m") is None
