"""Speech evaluation: word error rate of greedy transcription, real-time factor.

Protocol: every clip is cut into 30 s pieces (Whisper's window), log-mel features from the
model's ``WhisperFeatureExtractor``, greedy decoding through ``generate`` (no sampling, one
beam, no timestamps; multilingual models with the language and task of their generation
config, ``en`` / ``transcribe`` for the embedded ones), the pieces' texts joined. Reference
and hypothesis are normalised (lower case, punctuation removed, hyphens as spaces,
white space collapsed) and the corpus WER is computed with ``jiwer`` (total word errors /
total reference words). Real-time factor: transcription wall time / audio duration.

Registers the task metric ``wer`` (lower is better) for
``probe --probe leave-one-out --metric wer`` and the searches that take a task metric.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import torch

from prunelab.data.speech import RATE, SpeechSet, feature_extractor, load_speech
from prunelab.errors import ConfigError
from prunelab.eval.task_metric import TASK_METRICS, TaskMetric
from prunelab.models.size import model_size

WINDOW = 30 * RATE
_PUNCT = re.compile(r"[^\w\s']|_")


def is_speech_model(lm) -> bool:
    """True for a loaded Whisper (speech-to-text) model."""
    return getattr(getattr(lm.model, "config", None), "model_type", None) == "whisper"


def normalise(text: str) -> str:
    """Lower case, hyphens and punctuation as spaces, apostrophes dropped ("I'm" -> "im"),
    white space collapsed."""
    text = _PUNCT.sub(" ", text.lower().replace("-", " ")).replace("'", "")
    return " ".join(text.split())


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER after :func:`normalise` (jiwer); an empty reference counts its
    hypothesis' words as insertions over zero reference words only when all are empty."""
    import jiwer

    refs = [normalise(r) for r in references]
    hyps = [normalise(h) for h in hypotheses]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    if not pairs:
        raise ConfigError("word error rate needs at least one non-empty reference transcript")
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def _pieces(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[i:i + WINDOW] for i in range(0, max(len(audio), 1), WINDOW)]


@torch.no_grad()
def transcribe(lm, audios: list[np.ndarray], batch_size: int = 8,
               max_new_tokens: int = 220) -> list[str]:
    """Greedy transcripts of 16 kHz clips (cut into 30 s pieces, texts joined); at most
    ``16 + 6 x seconds`` new tokens per piece (``max_new_tokens`` at most)."""
    fe = feature_extractor(lm)
    owner, pieces = [], []
    for k, a in enumerate(audios):
        for p in _pieces(a):
            owner.append(k)
            pieces.append(p)
    model, texts = lm.model, [""] * len(pieces)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    for s in range(0, len(pieces), batch_size):
        chunk = pieces[s:s + batch_size]
        feats = fe(chunk, sampling_rate=RATE, return_tensors="pt")
        # a damaged model may loop: cap the text at ~6 tokens per second of audio
        cap = min(max_new_tokens, 16 + int(6 * max(len(p) for p in chunk) / RATE))
        ids = model.generate(feats.input_features.to(dev, dtype), do_sample=False, num_beams=1,
                             max_new_tokens=cap)
        texts[s:s + batch_size] = lm.tokenizer.batch_decode(ids, skip_special_tokens=True)
    joined = [""] * len(audios)
    for k, t in zip(owner, texts, strict=True):
        joined[k] = (joined[k] + " " + t.strip()).strip()
    return joined


def speech_scores(lm, data: SpeechSet, batch_size: int = 8) -> dict[str, Any]:
    """``wer`` over all clips, ``wer_real`` (recordings) / ``wer_synthetic`` (espeak)
    where present, ``real_time_factor``, ``audio_seconds``, ``transcripts``."""
    utts = list(data.utterances)
    if not utts:
        raise ConfigError(f"speech data {data.spec!r} holds no clips")
    start = time.perf_counter()
    hyps = transcribe(lm, [u.audio for u in utts], batch_size=batch_size)
    seconds = time.perf_counter() - start
    refs = [u.text for u in utts]
    out: dict[str, Any] = {"wer": word_error_rate(refs, hyps)}
    synth = [u.name.startswith("espeak-") for u in utts]
    for key, chosen in (("wer_real", [not s for s in synth]), ("wer_synthetic", synth)):
        if any(chosen) and not all(chosen):
            out[key] = word_error_rate([r for r, c in zip(refs, chosen, strict=True) if c],
                                       [h for h, c in zip(hyps, chosen, strict=True) if c])
    out.update(real_time_factor=seconds / max(data.seconds, 1e-9),
               audio_seconds=data.seconds, transcribe_seconds=seconds,
               transcripts=[{"name": u.name, "reference": u.text, "hypothesis": h}
                            for u, h in zip(utts, hyps, strict=True)])
    return out


def evaluate_speech(lm, data: str | SpeechSet = "speech", samples: int | None = None,
                    batch_size: int = 8) -> dict[str, Any]:
    """The ``evaluate`` result of a speech model: :func:`speech_scores` plus size, data
    and model."""
    speech = data if isinstance(data, SpeechSet) else load_speech(data, samples)
    res = speech_scores(lm, speech, batch_size=batch_size)
    res.update(model_size(lm.model))
    res["data"] = speech.to_dict()
    res["model"] = lm.spec
    res["samples"] = len(speech.utterances)
    return res


def speech_rows(res: dict) -> list[tuple[str, str]]:
    """Rows of the CLI's eval table for a speech result."""
    rows = [("WER", f"{res['wer']:.4f}")]
    rows += [(k, f"{res[k]:.4f}") for k in ("wer_real", "wer_synthetic") if k in res]
    rows += [("clips (audio seconds)", f"{res['samples']} ({res['audio_seconds']:.1f} s)"),
             ("real-time factor", f"{res['real_time_factor']:.4f}"),
             ("parameters", f"{res['params']:,}")]
    return rows


@TASK_METRICS.register(
    "wer", description="word error rate of greedy transcription (speech models)")
def wer_metric(lm, data: str | SpeechSet = "speech:synth-calib", samples: int | None = None,
               batch_size: int = 8) -> TaskMetric:
    """``wer`` bound to a speech set (loaded once): ``fn(lm) -> WER``. The default data is
    calibration speech (``speech:synth-calib``, 16 sentences), never the evaluation set."""
    if not is_speech_model(lm):
        raise ConfigError(f"--metric wer needs a speech model (Whisper); {lm.spec} is not one")
    speech = data if isinstance(data, SpeechSet) else load_speech(data, samples)

    def fn(model) -> float:
        return speech_scores(model, speech, batch_size=batch_size)["wer"]

    return TaskMetric("wer", fn, higher_is_better=False)
