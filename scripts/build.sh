#!/usr/bin/env bash
# Configures and builds kdn into build/ (Release, Ninja, ccache). Extra
# arguments go to cmake, e.g. scripts/build.sh -DKDN_CUDA=OFF
#   scripts/build.sh --configure-only [cmake args]   configures, builds nothing
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache's hashes hold paths relative to the clone, so that a clone in another
# folder (CI's) finds what an earlier one compiled.
export CCACHE_BASEDIR="$PWD"
configure_only=0
if [ "${1:-}" = "--configure-only" ]; then configure_only=1; shift; fi
jobs=$(nproc)
t0=$SECONDS
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >build.log 2>&1 || {
  cat build.log; exit 1; }
grep -E "^-- kdn:" build.log || true
echo "build: configured in $((SECONDS - t0)) s (cmake's output: build.log)"
[ $configure_only = 1 ] && exit 0
# Ninja shows its own progress: [done/total] per step.
t0=$SECONDS
cmake --build build -j "$jobs"
echo "build: built in $((SECONDS - t0)) s with $jobs jobs"
