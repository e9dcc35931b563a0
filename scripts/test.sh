#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine: installs the build
# dependencies and the test references, builds everything (CUDA code included
# when nvcc is present; warnings are errors), runs every test with ctest, then
# C++ unit tests under ASan+UBSan and under TSan (scripts/sanitize.sh), then
# checks the C++ layout (scripts/check-format.sh). Tests labelled `gpu`
# skip themselves where there is no GPU. This is what CI runs (.ci/run). Each
# part runs whatever the one before gave; the exit code is 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --ref
scripts/build.sh -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=ON -DKDN_REF_PYTHON="$PWD/.venv-ref/bin/python"
status=0
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 1500) || status=1
scripts/sanitize.sh || status=1
scripts/check-format.sh || status=1
exit $status
