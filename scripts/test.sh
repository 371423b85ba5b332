#!/usr/bin/env bash
# Set up, then run the test suite: the default run (tiny random models, a few minutes), then
# the slow checks on the real embedded models. Extra arguments go to both pytest runs.
# The default run is spread over two worker processes (pytest-xdist, one test file per
# worker at a time) with one math thread each: tiny models gain nothing from a second
# thread, and two threads per worker on two cores spin against each other.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 python3 -m pytest -m "not slow" -n "${PRUNELAB_TEST_WORKERS:-2}" \
  --dist loadfile "$@"
python3 -m pytest -m slow "$@"
