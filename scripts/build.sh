#!/usr/bin/env bash
# Configures and builds kdn into build/ (Release, Ninja, ccache). Extra
# arguments go to cmake, e.g. scripts/build.sh -DKDN_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >build.log 2>&1 || {
  cat build.log; exit 1; }
grep -E "^-- kdn:" build.log || true
cmake --build build -j "$jobs"
