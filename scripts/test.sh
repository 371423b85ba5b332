#!/usr/bin/env bash
# Set up, then run the test suite: the default run (tiny random models, a few minutes), then
# the slow checks on the real embedded models. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -m "not slow" "$@"
python3 -m pytest -m slow "$@"
