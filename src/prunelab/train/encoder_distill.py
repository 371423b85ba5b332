"""Distil a pruned Whisper encoder from the dense one on unlabelled speech.

The Whisper-encoder pruning study this follows removes encoder layers by their
leave-one-layer-out WER change and then distils the pruned encoder on unlabelled speech.
Here: the dense (teacher) encoder's final hidden states (after its last LayerNorm) on
unlabelled clips are the targets; the student's encoder parameters (only those; the
decoder stays frozen, so it still reads the representation it was trained on) are fitted
by AdamW to the mean squared error, full batch order fixed by the seed.

prunelab's heal loop (:mod:`prunelab.train.loop`) trains a causal LM on token windows (LM
losses, LoRA, masks); an encoder fed log-mel features with an MSE target does not fit it,
hence this small loop. Audio: sentences packed into clips of up to 30 s (Whisper always
encodes 30 s, so packing puts speech, not padding, in the frames).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from prunelab.data.speech import RATE, feature_extractor, load_speech
from prunelab.log import info
from prunelab.registry import check_range


@dataclass(frozen=True)
class EncoderDistill:
    """Steps, batch size, learning rate, unlabelled data (speech spec) and its size."""

    steps: int = 40
    batch_size: int = 2
    lr: float = 1e-4
    data: str = "speech:synth-calib"
    sentences: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        check_range("steps", self.steps, 1, None, integer=True)
        check_range("batch_size", self.batch_size, 1, None, integer=True)
        check_range("lr", self.lr, 1e-9, 1.0)
        check_range("sentences", self.sentences, 1, None, integer=True)


def pack_clips(audios: list[np.ndarray], seconds: float = 29.0,
               gap: float = 0.3) -> list[np.ndarray]:
    """Concatenate clips (with ``gap`` s of silence) into pieces of at most ``seconds``;
    a clip longer than that is a piece of its own."""
    limit, pad = int(seconds * RATE), np.zeros(int(gap * RATE), np.float32)
    out, cur = [], []
    for a in audios:
        if cur and sum(len(c) for c in cur) + len(pad) + len(a) > limit:
            out.append(np.concatenate(cur))
            cur = []
        cur += [pad, a] if cur else [a]
    if cur:
        out.append(np.concatenate(cur))
    return out


def _encode(model, feats: torch.Tensor) -> torch.Tensor:
    return model.model.encoder(input_features=feats).last_hidden_state


def distill_encoder(student_lm, teacher_lm, cfg: EncoderDistill = EncoderDistill()) -> dict:
    """Fit ``student_lm``'s encoder to ``teacher_lm``'s final encoder states (MSE) on
    unlabelled packed speech; returns ``{"mse_before", "mse_after", "steps", "clips",
    "audio_seconds", "seconds"}`` (MSE over all clips, float32)."""
    speech = load_speech(cfg.data, cfg.sentences)
    clips = pack_clips([u.audio for u in speech.utterances])
    fe = feature_extractor(student_lm)
    feats = fe(clips, sampling_rate=RATE, return_tensors="pt").input_features
    student, teacher = student_lm.model, teacher_lm.model
    with torch.no_grad():
        targets = torch.cat([_encode(teacher, feats[i:i + 4]) for i in range(0, len(feats), 4)])
    params = [p for p in student.model.encoder.parameters()]
    frozen = {p: p.requires_grad for p in student.parameters()}
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    before = _mse(student, feats, targets)
    try:
        student.train(False)  # no dropout; gradients still flow
        for step in range(cfg.steps):
            idx = torch.randperm(len(feats), generator=gen)[:cfg.batch_size]
            loss = torch.nn.functional.mse_loss(_encode(student, feats[idx]), targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if (step + 1) % 10 == 0:
                info(f"prunelab: encoder distillation step {step + 1}/{cfg.steps} "
                     f"mse {float(loss):.5f}")
    finally:
        for p, g in frozen.items():
            p.requires_grad_(g)
        student.eval()
    return {"mse_before": before, "mse_after": _mse(student, feats, targets),
            "steps": cfg.steps, "clips": len(clips), "audio_seconds": speech.seconds,
            "seconds": time.perf_counter() - start}


@torch.no_grad()
def _mse(model, feats: torch.Tensor, targets: torch.Tensor) -> float:
    total = 0.0
    for i in range(0, len(feats), 4):
        out = _encode(model, feats[i:i + 4])
        total += float(((out - targets[i:i + 4]) ** 2).sum())
    return total / targets.numel()
