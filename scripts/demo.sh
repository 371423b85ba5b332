#!/usr/bin/env bash
# Set up, then run the demo recipe on the embedded model (SmolLM2-135M) and data
# (wiki-vital, ARC-Easy): probes, depth pruning by two probes with and without recovery,
# 50 % Wanda, 20 % FFN width, one evaluation of each, the leaderboard and the HTML report.
# A rerun resumes (finished stages are not redone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
prunelab info --model smollm2-135m
prunelab run recipes/demo.yaml --out "${DEMO_OUT:-out/demo}"
