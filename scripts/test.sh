#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine: installs the build
# dependencies and the test references, builds everything (CUDA code included
# when nvcc is present; warnings are errors), runs every test with ctest, then
# C++ unit tests under ASan+UBSan (with the fuzz tests) and under TSan
# (scripts/sanitize.sh), then checks the C++ layout (scripts/check-format.sh).
# After ctest it also runs the README's first command, scripts/demo.sh.
# Tests labelled `gpu` skip themselves where there is no GPU. This is what CI
# runs (.ci/run). Each part runs whatever the one before gave; the exit code
# is 1 if any failed.
#
# Some parts run beside others, on what the machine leaves idle: the Python
# and llama.cpp references install while kdn builds, which needs none of
# them; the sanitizer builds run at the lowest priority (nice 19) while ctest
# and the demo run, whose tests wait on processes and sockets much of the
# time; the ASan and TSan runs go side by side. Their logs: build-refs.log,
# build-sanitize.log, sanitize-asan.log, sanitize-tsan.log. At the end, whatever failed, a table of the phases: when
# each began and ended (seconds from the start), how long it took, which
# ran beside others, and how long the run waited for each of those once it
# had nothing else to do (docs/design.md, "Continuous integration").
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache's hashes hold paths relative to the clone, so that a clone in another
# folder (CI's) finds what an earlier one compiled.
export CCACHE_BASEDIR="$PWD"

rows=()
status=0
# row NAME START END RC [NOTE]: one line of the table.
row() {
  rows+=("$(printf '%-36s %5d %5d %5d s  %-14s %s' "$1" "$2" "$3" $(($3 - $2)) \
    "$([ "$4" = 0 ] && echo ok || echo "FAILED (rc $4)")" "${5:-}")")
  [ "$4" = 0 ] || status=1
}
# phase NAME COMMAND...: runs it in the foreground, times it.
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  row "$name" "$t0" "$SECONDS" "$rc"
  return $rc
}
# beside NAME LOG COMMAND...: starts it in the background (its output in
# LOG); `joined NAME` waits for it. It writes its exit code and end time to
# a file of its own, so the table has when it ended, not when it was joined.
declare -A bg_pid=() bg_start=() bg_log=()
bg_count=0
beside() {
  local name=$1 log=$2
  shift 2
  bg_count=$((bg_count + 1))
  local mark="$PWD/.test-sh-$bg_count.end"
  rm -f "$mark"
  ( rc=0; "$@" > "$log" 2>&1 || rc=$?; echo "$rc $SECONDS" > "$mark"; exit "$rc" ) &
  bg_pid[$name]=$!
  bg_start[$name]=$SECONDS
  bg_log[$name]="$log:$mark"
}
joined() {
  local name=$1 t0=$SECONDS rc=0 end
  wait "${bg_pid[$name]}" || rc=$?
  local log=${bg_log[$name]%%:*} mark=${bg_log[$name]##*:}
  end=$SECONDS
  if [ -f "$mark" ]; then read -r rc end < "$mark"; rm -f "$mark"; fi
  [ "$rc" = 0 ] || { echo "test.sh: $name failed; the end of $log:"; tail -n 40 "$log"; }
  row "$name" "${bg_start[$name]}" "$end" "$rc" "beside; waited $((SECONDS - t0)) s"
  return "$rc"
}
report() {
  echo
  echo "test.sh: phases (seconds from the start of the run)"
  printf '  %-36s %5s %5s %7s  %-14s %s\n' phase start end took result note
  for r in "${rows[@]}"; do echo "  $r"; done
  printf '  %-36s %5s %5d s\n' total "" $SECONDS
}
trap report EXIT

phase "install (packages)" scripts/install-deps.sh --ref-packages || exit 1
beside "install (references)" build-refs.log scripts/install-deps.sh --ref
phase configure scripts/build.sh --configure-only -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=ON \
  -DKDN_REF_PYTHON="$PWD/.venv-ref/bin/python" || exit 1
phase build cmake --build build -j "$(nproc)" || exit 1
joined "install (references)" || exit 1
beside "sanitizer builds (nice 19)" build-sanitize.log nice -n 19 scripts/sanitize.sh --build-only
phase ctest bash -c 'cd build && ctest --output-on-failure -j "$(nproc)" --timeout 1500' || true
# The README's first command on this clone: the demo on SmolLM2 (the tree is
# built and the model fetched by now, so it costs the demo's own minute).
phase "demo (README's first command)" bash scripts/demo.sh --run-dir build/demo-run || true
joined "sanitizer builds (nice 19)" || true
# Each sanitizer's unit tests run one binary at a time, most of them on one
# thread: the two go side by side.
beside sanitize-asan sanitize-asan.log scripts/sanitize.sh asan
beside sanitize-tsan sanitize-tsan.log scripts/sanitize.sh tsan
phase format scripts/check-format.sh || true
joined sanitize-asan || true
joined sanitize-tsan || true
exit $status
