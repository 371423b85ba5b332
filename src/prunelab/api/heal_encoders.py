"""Spec-level healing of encoders (what ``prunelab heal`` calls on a vision or speech
model): the modality of a loaded model, its unlabelled training and held-out inputs from
data specs, and :func:`~prunelab.train.encoders.heal_encoder`.

Vision (``dinov2``, ``vit``): ``images:calib`` (augmented photos) for training and
``images:test`` held out, at ``image_size`` px; when the held-out spec is the training
spec the held-out images are drawn from the next seed stream, so they are never training
tensors. Speech (Whisper): ``speech:synth-calib[:N]`` sentences (espeak-ng) for training
and ``speech:synth-test[:N]`` held out (or folders of clips), packed into clips of up to
30 s (:func:`~prunelab.train.encoder_distill.pack_clips`), log-mel features. The text
defaults (``wiki-vital:calib`` / ``wiki-vital:test``) mean these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prunelab import api
from prunelab.data.images import images_for
from prunelab.data.speech import RATE, feature_extractor, load_speech
from prunelab.errors import ConfigError
from prunelab.eval.speech import is_speech_model
from prunelab.io.manifest import source_manifest
from prunelab.models.embedded import EMBEDDED
from prunelab.models.families import family_for_model_type, original_model_type
from prunelab.models.whisper import use_stack
from prunelab.train.encoder_distill import pack_clips
from prunelab.train.encoders import EncoderHealConfig, heal_encoder

VISION_TRAIN, VISION_EVAL = 64, 32
SPEECH_TRAIN, SPEECH_EVAL = 48, 16


def encoder_modality(lm) -> str | None:
    """``"vision"`` (DINOv2 / ViT), ``"speech"`` (Whisper) or ``None`` (text)."""
    if lm.adapter.is_vision:
        return "vision"
    if is_speech_model(lm):
        return "speech"
    return None


def _images(spec: str, samples: int, size: int, seed: int, split: str) -> tuple:
    if spec.startswith("wiki-vital"):
        spec = f"images:{split}"
    data = images_for(spec, samples=samples, seed=seed, size=size)
    return data.input_ids, data.to_dict()


def vision_inputs(data: str, eval_data: str | None, train_samples: int | None,
                  eval_samples: int | None, size: int, seed: int = 0) -> tuple:
    """``(train pixels, held-out pixels or None, data record)``."""
    train, train_rec = _images(data, train_samples or VISION_TRAIN, size, seed, "calib")
    if eval_data is None:
        return train, None, {"train": train_rec, "eval": None}
    same = (eval_data.replace("wiki-vital:test", "images:test") ==
            train_rec["spec"])
    held, eval_rec = _images(eval_data, eval_samples or VISION_EVAL, size,
                             seed + 1 if same else seed, "test")
    return train, held, {"train": train_rec, "eval": eval_rec}


def _speech(lm, spec: str, samples: int, split: str) -> tuple:
    if spec.startswith("wiki-vital"):
        spec = f"speech:synth-{split}"
    speech = load_speech(spec, samples)
    if not speech.utterances:
        raise ConfigError(f"speech data {spec!r} holds no clips")
    clips = pack_clips([u.audio for u in speech.utterances])
    feats = feature_extractor(lm)(clips, sampling_rate=RATE,
                                  return_tensors="pt").input_features.to(torch.float32)
    rec = {"spec": spec, "sentences": len(speech.utterances), "clips": len(clips),
           "audio_seconds": round(speech.seconds, 2)}
    return feats, rec


def speech_inputs(lm, data: str, eval_data: str | None, train_samples: int | None,
                  eval_samples: int | None) -> tuple:
    """``(train features, held-out features or None, data record)``."""
    train, train_rec = _speech(lm, data, train_samples or SPEECH_TRAIN, "calib")
    if eval_data is None:
        return train, None, {"train": train_rec, "eval": None}
    held, eval_rec = _speech(lm, eval_data, eval_samples or SPEECH_EVAL, "test")
    if eval_rec["spec"] == train_rec["spec"]:
        raise ConfigError(f"the held-out clips ({eval_rec['spec']}) are the training clips: "
                          "give another --eval-data (or none)")
    return train, held, {"train": train_rec, "eval": eval_rec}


def heal_encoder_specs(lm, teacher, data: str = "wiki-vital:calib",
                       eval_data: str | None = "wiki-vital:test",
                       config: EncoderHealConfig | None = None,
                       train_samples: int | None = None, eval_samples: int | None = None,
                       image_size: int = 224, load_options: dict | None = None):
    """Heal the loaded encoder ``lm`` from ``teacher`` (a spec or a loaded model) on the
    inputs of ``data`` / ``eval_data`` (module docstring); returns ``(lm, record)`` with
    ``record["data"]`` naming the inputs."""
    cfg = config or EncoderHealConfig()
    modality = encoder_modality(lm)
    if modality is None:
        raise ConfigError(f"{lm.spec} is not a vision or speech encoder")
    if teacher is None:
        raise ConfigError("healing an encoder distils it from the dense model: give "
                          "--teacher")
    opts = {k: v for k, v in (load_options or {}).items() if k not in ("dtype", "device")}
    ref = api.load(teacher, dtype=lm.dtype, device=str(lm.device), **opts) \
        if isinstance(teacher, str) else api._as_loaded(teacher)
    if encoder_modality(ref) != modality:
        raise ConfigError(f"the teacher {ref.spec} is not a {modality} model like the student")
    if modality == "speech":
        use_stack(lm, "encoder")
        use_stack(ref, "encoder")
        train, held, rec = speech_inputs(lm, data, eval_data, train_samples, eval_samples)
    else:
        train, held, rec = vision_inputs(data, eval_data, train_samples, eval_samples,
                                         image_size, cfg.seed)
    lm, record = heal_encoder(lm, ref, train, held, cfg, manifest=source_manifest(lm))
    record["data"] = rec
    if modality == "vision":
        record["image_size"] = image_size
    return lm, record


_EMBEDDED_KINDS = {"onnx-dinov2": "vision", "ct2-whisper": "speech"}


def peek_modality(spec: str) -> str | None:
    """The modality of a model spec without loading it: an embedded model's kind, or a
    local checkpoint's ``config.json`` ``model_type``; ``None`` for text models and for
    specs that cannot be read this way (hub ids)."""
    if spec in EMBEDDED:
        return _EMBEDDED_KINDS.get(EMBEDDED[spec].kind)
    cfg = Path(spec).expanduser() / "config.json"
    try:
        model_type = original_model_type(json.loads(cfg.read_text()).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return None
    if model_type == "whisper":
        return "speech"
    fam = family_for_model_type(model_type)
    return "vision" if fam is not None and fam.modality == "vision" else None
