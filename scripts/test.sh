#!/usr/bin/env bash
# Set up, then run the whole test suite (tiny random models + slow real-model checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest "$@"
