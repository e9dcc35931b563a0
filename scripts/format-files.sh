#!/usr/bin/env bash
# The files scripts/format.sh and scripts/check-format.sh cover: kdn's own C++
# and CUDA sources under git, one per line.
set -euo pipefail
cd "$(dirname "$0")/.."
git ls-files -- '*.h' '*.cpp' '*.cc' '*.cu' '*.cuh'
