#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine: installs the build
# dependencies and the test references, builds everything (CUDA code included
# when nvcc is present; warnings are errors), runs every test with ctest, then
# C++ unit tests under ASan+UBSan (with the fuzz tests) and under TSan
# (scripts/sanitize.sh), then checks the C++ layout (scripts/check-format.sh).
# After ctest it also runs the README's first command, scripts/demo.sh.
# Tests labelled `gpu` skip themselves where there is no GPU. This is what CI
# runs (.ci/run). Each part runs whatever the one before gave; the exit code
# is 1 if any failed. At the end, whatever failed, a table of how long each
# phase took.
#
# Two things run beside others, on what the machine leaves idle: the Python
# references (pip, llama.cpp's tokenizer, SmolLM2) install while kdn builds,
# which needs none of them; the sanitizer builds run at the lowest priority
# (nice 19) while ctest runs, whose tests wait on processes and sockets much
# of the time. Their logs: build-refs.log, build-sanitize.log.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=()
status=0
# phase NAME COMMAND...: runs it, times it, remembers a failure.
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  phases+=("$(printf '%-34s %6d s  %s' "$name" $((SECONDS - t0)) "$([ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)")")")
  [ $rc = 0 ] || status=1
  return $rc
}
report() {
  echo
  echo "test.sh: phases"
  for p in "${phases[@]}"; do echo "  $p"; done
  printf '  %-34s %6d s\n' total $SECONDS
}
trap report EXIT
# wait_for PID LOG: waits for a job started beside the others; its log on failure.
wait_for() {
  local rc=0
  wait "$1" || rc=$?
  [ $rc = 0 ] || { echo "test.sh: $2 says:"; tail -n 40 "$2"; }
  return $rc
}

phase "install (packages)" scripts/install-deps.sh --ref-packages || exit 1
scripts/install-deps.sh --ref > build-refs.log 2>&1 &
refs=$!
phase configure scripts/build.sh --configure-only -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=ON \
  -DKDN_REF_PYTHON="$PWD/.venv-ref/bin/python" || exit 1
phase build cmake --build build -j "$(nproc)" || exit 1
phase "install (references), after build" wait_for $refs build-refs.log || exit 1
nice -n 19 scripts/sanitize.sh --build-only > build-sanitize.log 2>&1 &
sanitize_build=$!
phase ctest bash -c 'cd build && ctest --output-on-failure -j "$(nproc)" --timeout 1500' || true
# The README's first command on this clone: the demo on SmolLM2 (the tree is
# built and the model fetched by now, so it costs the demo's own minute).
phase "demo (README's first command)" bash scripts/demo.sh --run-dir build/demo-run || true
phase "sanitizer builds, after ctest" wait_for $sanitize_build build-sanitize.log || true
phase sanitize-asan scripts/sanitize.sh asan || true
phase sanitize-tsan scripts/sanitize.sh tsan || true
phase format scripts/check-format.sh || true
exit $status
