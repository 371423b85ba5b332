#!/usr/bin/env bash
# Set up, then run the test suite: the default run (tiny random models, a few minutes), then
# the slow checks on the real embedded models. Extra arguments go to both pytest runs.
# The default run is spread over two worker processes (pytest-xdist, one test file per
# worker at a time) with one math thread each: tiny models gain nothing from a second
# thread, and two threads per worker on two cores spin against each other.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llama.cpp, to check GGUF exports where they are served: llama-cpp-python has no binary
# wheel on PyPI, so pip compiles llama.cpp (about 4 min on 2 cores, once: pip caches the
# wheel). Portable CPU flags: the native build crashes on its first decode on CPUs that
# report AVX-512 / AMX here. The tests that need it skip with a reason when it is missing.
python3 -c "import llama_cpp" 2>/dev/null || \
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  "llama-cpp-python==0.3.36" || echo "note: llama-cpp-python not built (llama.cpp checks skip)"
OMP_NUM_THREADS=1 python3 -m pytest -m "not slow" -n "${PRUNELAB_TEST_WORKERS:-2}" \
  --dist loadfile "$@"
python3 -m pytest -m slow "$@"
