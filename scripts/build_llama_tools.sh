#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-imatrix, llama-quantize, llama-perplexity)
# from the llama.cpp sources inside the llama-cpp-python sdist that prunelab's llama.cpp
# bindings are built from (fetched by pip by name and version: its index, mirrors and cache
# apply), with the portable CPU flags scripts/test.sh uses. Only the benchmarks use them
# (benchmarks/imatrix_check.py checks prunelab's importance matrix against llama-imatrix);
# prunelab itself needs none of them.
#
#   bash scripts/build_llama_tools.sh            # prints the folder holding the binaries
#
# About 6 minutes on 2 cores the first time; then the folder is reused.
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)" 2>/dev/null || echo 0.3.36)
CACHE="${PRUNELAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prunelab}/llama-tools/$VERSION"
BIN="$CACHE/build/bin"
if [ -x "$BIN/llama-imatrix" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-perplexity" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$CACHE"
if [ ! -d "$CACHE/src" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$CACHE/src"
  rm -rf "$tmp"
fi
cmake -S "$CACHE/src" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$CACHE/build" -j "$(nproc)" --target llama-imatrix llama-quantize \
  llama-perplexity >&2
echo "$BIN"
