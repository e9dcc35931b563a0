#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine: installs the build
# dependencies and the test references, builds everything (CUDA code included
# when nvcc is present; warnings are errors), runs every test with ctest, then
# C++ unit tests under ASan+UBSan and under TSan (scripts/sanitize.sh), then
# checks the C++ layout (scripts/check-format.sh). Tests labelled `gpu`
# skip themselves where there is no GPU. This is what CI runs (.ci/run). Each
# part runs whatever the one before gave; the exit code is 1 if any failed.
# At the end, whatever failed, a table of how long each phase took.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=()
status=0
# phase NAME COMMAND...: runs it, times it, remembers a failure.
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  phases+=("$(printf '%-22s %6d s  %s' "$name" $((SECONDS - t0)) "$([ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)")")")
  [ $rc = 0 ] || status=1
  return $rc
}
report() {
  echo
  echo "test.sh: phases"
  for p in "${phases[@]}"; do echo "  $p"; done
  printf '  %-22s %6d s\n' total $SECONDS
}
trap report EXIT

phase install scripts/install-deps.sh --ref || exit 1
phase configure scripts/build.sh --configure-only -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=ON \
  -DKDN_REF_PYTHON="$PWD/.venv-ref/bin/python" || exit 1
phase build cmake --build build -j "$(nproc)" || exit 1
phase ctest bash -c 'cd build && ctest --output-on-failure -j "$(nproc)" --timeout 1500' || true
phase sanitize-asan scripts/sanitize.sh asan || true
phase sanitize-tsan scripts/sanitize.sh tsan || true
phase format scripts/check-format.sh || true
exit $status
