"""Speech with reference transcripts: real clips, synthesised sentences, a user folder.

Specs (``--data`` of a speech model):

``speech`` (= ``speech:test``)
    The embedded evaluation set: the two real recordings of ``speech:reference`` plus
    ``speech:synth-test`` (``samples`` sentences, default 16).
``speech:reference``
    ``pyannote-audio==4.0.7``'s ``pyannote/audio/sample/sample.wav`` (30 s, two speakers;
    transcript: the ``sample.stm`` segments in time order) and CMU ARCTIC ``arctic_a0007``
    ("And you always want to see it in the superlative degree."), shipped in the
    ``pysptk==1.0.1`` sdist and extracted by ``scripts/setup.sh`` into
    ``<cache>/speech/arctic_a0007.wav`` (left out, with a note, when absent).
``speech:synth-test`` / ``speech:synth-calib``
    Sentences of the embedded text corpus (``wiki-vital:test`` / ``wiki-vital:calib``, so
    evaluation and distillation audio never share a sentence) spoken by Debian's
    ``espeak-ng`` (voice ``en-us``), resampled to 16 kHz and cached as
    ``<cache>/speech/espeak/<sha1>.wav``. Sentences: 6 to 20 words of letters and simple
    punctuation (no digits), in a fixed order (sha1 of the sentence), the first ``samples``
    (or ``N`` of a ``speech:synth-calib:N`` / ``speech:test:N`` spec).
``PATH`` (a folder)
    Audio files with transcripts: every ``NAME.wav`` with a ``NAME.txt`` beside it (the
    transcript, one line or several), or a ``transcripts.tsv`` whose lines are
    ``FILE<TAB>TRANSCRIPT`` (FILE relative to the folder). WAV only (any rate, mono or
    stereo; PCM or float); clips are resampled to 16 kHz and averaged to mono.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from math import gcd
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from scipy.io import wavfile
from scipy.signal import resample_poly

from prunelab.data import TokenBatches
from prunelab.data.sources import load_text_source
from prunelab.errors import DataError
from prunelab.paths import cache_dir, package_file

RATE = 16000
ARCTIC_A0007 = "And you always want to see it in the superlative degree."


@dataclass(frozen=True)
class Utterance:
    """One clip: ``audio`` float32 mono at 16 kHz in [-1, 1], and its transcript."""

    name: str
    audio: np.ndarray
    text: str

    @property
    def seconds(self) -> float:
        return len(self.audio) / RATE


@dataclass(frozen=True)
class SpeechSet:
    """Utterances with the spec that produced them."""

    spec: str
    utterances: tuple[Utterance, ...]
    notes: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return float(sum(u.seconds for u in self.utterances))

    def to_dict(self) -> dict:
        return {"spec": self.spec, "utterances": len(self.utterances),
                "seconds": round(self.seconds, 3), "names": [u.name for u in self.utterances],
                "notes": list(self.notes)}


def resample(audio: np.ndarray, rate: int, target: int = RATE) -> np.ndarray:
    """``audio`` at ``rate`` Hz resampled to ``target`` (polyphase, scipy)."""
    if rate == target:
        return audio.astype(np.float32)
    g = gcd(int(rate), int(target))
    return resample_poly(audio, target // g, rate // g).astype(np.float32)


def load_wav(path: str | Path) -> np.ndarray:
    """A WAV file as float32 mono 16 kHz in [-1, 1] (integer PCM scaled by its range)."""
    try:
        rate, data = wavfile.read(str(path))
    except (ValueError, OSError) as exc:
        raise DataError(f"cannot read {path} as WAV: {str(exc).splitlines()[0][:120]}") from exc
    if data.dtype == np.uint8:  # 8-bit WAV is unsigned, centred on 128
        data = (data.astype(np.float64) - 128.0) / 128.0
    elif np.issubdtype(data.dtype, np.integer):
        data = data.astype(np.float64) / float(-np.iinfo(data.dtype).min)
    data = np.asarray(data, dtype=np.float64)
    if data.ndim == 2:
        data = data.mean(axis=1)
    return resample(data, rate)


# ------------------------------------------------------------------ embedded real clips
def _pyannote_dir() -> Path | None:
    wav = package_file("pyannote-audio", "pyannote.audio", "sample/sample.wav")
    return wav.parent if wav is not None else None


def stm_transcript(path: Path) -> str:
    """The words of an STM file (``file channel speaker start end words...``) in start
    order; ``;;`` comment lines skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and not line.startswith(";;"):
            rows.append((float(parts[3]), parts[5].strip()))
    return " ".join(t for _, t in sorted(rows, key=lambda r: r[0]))


def arctic_path() -> Path:
    return cache_dir() / "speech" / "arctic_a0007.wav"


def reference_clips() -> tuple[list[Utterance], list[str]]:
    """The real recordings available here and notes on those missing."""
    clips, notes = [], []
    folder = _pyannote_dir()
    if folder is not None:
        clips.append(Utterance("pyannote-sample", load_wav(folder / "sample.wav"),
                               stm_transcript(folder / "sample.stm")))
    else:
        notes.append("pyannote sample missing: pip install --no-deps pyannote-audio==4.0.7")
    if arctic_path().is_file():
        clips.append(Utterance("arctic_a0007", load_wav(arctic_path()), ARCTIC_A0007))
    else:
        notes.append(f"arctic_a0007.wav missing ({arctic_path()}): run scripts/setup.sh")
    return clips, notes


# ------------------------------------------------------------------ synthesised sentences
_SENT = re.compile(r"(?<=[.!?])\s+")
_CLEAN = re.compile(r"^[A-Za-z][A-Za-z ,;'\-]*[A-Za-z]{3}[.!?]$")


def corpus_sentences(split: str, count: int) -> list[str]:
    """``count`` sentences of ``wiki-vital:<split>`` (6-20 words, letters and simple
    punctuation only), ordered by the sha1 of the sentence (a fixed, spread sample)."""
    seen, keep = set(), []
    for doc in load_text_source(f"wiki-vital:{split}").documents:
        for s in _SENT.split(doc.replace("\n", " ")):
            s = s.strip()
            if s not in seen and _CLEAN.match(s) and 6 <= len(s.split()) <= 20:
                seen.add(s)
                keep.append(s)
    keep.sort(key=lambda s: hashlib.sha1(s.encode("utf-8")).hexdigest())
    return keep[:count]


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesise(text: str, voice: str = "en-us") -> np.ndarray:
    """``text`` spoken by espeak-ng, 16 kHz float32; cached by sha1(voice, text)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise DataError("espeak-ng is not installed (apt-get install espeak-ng): the "
                        "synthesised speech set needs it")
    key = hashlib.sha1(f"{voice}\n{text}".encode()).hexdigest()
    path = cache_dir() / "speech" / "espeak" / f"{key}.wav"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".wav.part")
        os.close(fd)
        try:
            subprocess.run([exe, "-v", voice, "-w", tmp, text], check=True,
                           capture_output=True, timeout=60)

            wavfile.write(tmp + "16", RATE, (load_wav(tmp) * 32767).astype(np.int16))
            os.replace(tmp + "16", path)
        finally:
            Path(tmp).unlink(missing_ok=True)
            Path(tmp + "16").unlink(missing_ok=True)
    return load_wav(path)


def synthetic_set(split: str, samples: int) -> list[Utterance]:
    return [Utterance(f"espeak-{split}-{i}", synthesise(s), s)
            for i, s in enumerate(corpus_sentences(split, samples))]


# ------------------------------------------------------------------ user folders
def folder_set(path: Path) -> list[Utterance]:
    """Clips of a folder (schema in the module docstring)."""
    tsv = path / "transcripts.tsv"
    pairs: list[tuple[Path, str]] = []
    if tsv.is_file():
        for n, line in enumerate(tsv.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            name, tab, text = line.partition("\t")
            if not tab:
                raise DataError(f"{tsv}:{n}: expected FILE<TAB>TRANSCRIPT")
            pairs.append((path / name.strip(), text.strip()))
    else:
        for wav in sorted(path.rglob("*.wav")):
            txt = wav.with_suffix(".txt")
            if txt.is_file():
                pairs.append((wav, " ".join(txt.read_text(encoding="utf-8").split())))
    if not pairs:
        raise DataError(f"{path} holds no speech with transcripts (NAME.wav + NAME.txt, or "
                        "transcripts.tsv with FILE<TAB>TRANSCRIPT lines)")
    missing = [str(p) for p, _ in pairs if not p.is_file()]
    if missing:
        raise DataError(f"{path}: audio files listed but missing: {missing[:3]}")
    return [Utterance(p.stem, load_wav(p), t) for p, t in pairs]


def load_speech(spec: str = "speech", samples: int | None = None) -> SpeechSet:
    """Resolve a speech spec (module docstring) into a :class:`SpeechSet`."""
    kind, _, split = spec.partition(":")
    head, colon, count = split.rpartition(":")
    if colon and count.isdigit():  # speech:synth-calib:48
        split, samples = head, int(count)
    n = 16 if samples is None else int(samples)
    if n < 0:
        raise DataError(f"--samples must be >= 0, got {n}")
    if kind == "speech":
        split = split or "test"
        if split == "reference":
            clips, notes = reference_clips()
            return SpeechSet(spec, tuple(clips), tuple(notes))
        if split in ("synth-test", "synth-calib"):
            return SpeechSet(spec, tuple(synthetic_set(split[6:], n)))
        if split == "test":
            clips, notes = reference_clips()
            return SpeechSet(spec, tuple(clips + synthetic_set("test", n)), tuple(notes))
        raise DataError(f"unknown speech spec {spec!r}: speech[:test|reference|synth-test|"
                        "synth-calib] or a folder")
    path = Path(spec).expanduser()
    if path.is_dir():
        return SpeechSet(str(path), tuple(folder_set(path)))
    raise DataError(f"speech data {spec!r} is neither a speech spec (speech, "
                    "speech:reference, speech:synth-test, speech:synth-calib) nor a folder")


def feature_batches(lm, data: str, samples: int | None = None, seed: int = 0,
                    mode: str | None = None):
    """Calibration "windows" of a speech encoder: the log-mel features ``[N, mel, 3000]``
    (first 30 s of each clip) of a speech set, as :class:`~prunelab.data.TokenBatches`
    (``input_ids`` holds the features; the block runner feeds them to the encoder). A
    text spec (``wiki-vital:...``, the text default) means ``speech:synth-calib`` for
    calibration and ``speech`` for tests. ``seed`` is recorded only (the order is fixed)."""
    if data.startswith("wiki-vital"):
        data = "speech" if mode == "test" else "speech:synth-calib"
    speech = load_speech(data, samples)
    if not speech.utterances:
        raise DataError(f"speech data {data!r} holds no clips")
    fe = feature_extractor(lm)
    feats = fe([u.audio[:30 * RATE] for u in speech.utterances], sampling_rate=RATE,
               return_tensors="pt").input_features.to(torch.float32)
    digest = hashlib.sha256(feats.numpy().tobytes()).hexdigest()
    return TokenBatches(input_ids=feats, spec=data, seqlen=int(feats.shape[-1]),
                        samples=int(feats.shape[0]), seed=seed, mode=mode or "calib",
                        total_windows=int(feats.shape[0]), sha256=digest)


def feature_extractor(lm):
    """The model's ``WhisperFeatureExtractor`` (from its checkpoint folder, else the
    default one with the model's mel bins)."""
    cached = getattr(lm, "_speech_features", None)
    if cached is not None:
        return cached
    src = Path(str(lm.source))
    if any((src / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        fe = tf.WhisperFeatureExtractor.from_pretrained(src)
    else:
        fe = tf.WhisperFeatureExtractor(feature_size=int(lm.model.config.num_mel_bins))
    lm._speech_features = fe
    return fe
