#!/usr/bin/env bash
# Set up, then run the demo on the embedded model (SmolLM2-135M) and data (wiki-vital).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
prunelab info --model smollm2-135m
prunelab eval --model smollm2-135m --data wiki-vital:test --seqlen 512 --samples 16 --speed
