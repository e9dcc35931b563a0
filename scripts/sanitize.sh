#!/usr/bin/env bash
# C++ unit tests (gtest binaries of tests/CMakeLists.txt) under the
# sanitizers, each in a build of its own with only what those tests need
# (no CUDA, no kdn-bench, no deployment tests):
#   asan   AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer, in
#          build-asan/
#   tsan   ThreadSanitizer, in build-tsan/
# Any report fails the run: every sanitizer halts on its first error
# (-fno-sanitize-recover=all, halt_on_error=1) and the test binary exits
# non-zero. scripts/test.sh runs both after the main ctest; CI runs that.
#
#   scripts/sanitize.sh            both
#   scripts/sanitize.sh tsan       one
# Extra cmake arguments can come in $KDN_SANITIZE_CMAKE_ARGS.
# Warnings are the main build's business (-Werror there), not these builds'.
# Suppressions (scripts/sanitize/tsan.supp) name third-party code only, each
# with its reason.
#
# Under TSan, OpenMP and OpenBLAS run on one thread: libgomp is not built with
# TSan, so its barriers would be reported as races that are not there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The binaries each sanitizer runs: those found clean so far. ASan+UBSan
# runs every unit-test binary. Under TSan the others (kdn_kvbus_tests and
# the rest) join the list once they have been run under it and what it
# reports is fixed.
ASAN_TESTS=(kdn_common_tests kdn_model_tests kdn_text_tests kdn_engine_tests kdn_kvbus_tests
            kdn_kvbridge_tests kdn_decode_worker_tests kdn_blend_tests kdn_serving_tests
            kdn_router_tests)
TSAN_TESTS=(kdn_common_tests)
SUPP="$PWD/scripts/sanitize"

run_one() {
  local kind=$1 flags dir=build-$1 tests
  case "$kind" in
    asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=all" tests=("${ASAN_TESTS[@]}") ;;
    tsan) flags="-fsanitize=thread" tests=("${TSAN_TESTS[@]}") ;;
    *) echo "sanitize: unknown sanitizer '$kind' (asan or tsan)" >&2; return 2 ;;
  esac
  flags="-O1 -g -fno-omit-frame-pointer $flags"
  local t0=$SECONDS
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Sanitize -DKDN_CUDA=OFF \
    -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=OFF -DKDN_REF_PYTHON= -DKDN_WERROR=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" \
    ${KDN_SANITIZE_CMAKE_ARGS:-} >"$dir/configure.log" 2>&1 || {
    cat "$dir/configure.log"; return 1; }
  cmake --build "$dir" -j "$(nproc)" --target "${tests[@]}"
  local built=$SECONDS failed=()
  for t in "${tests[@]}"; do
    echo "sanitize: $kind $t"
    if ! ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=1" \
         UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
         TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp" \
         OMP_NUM_THREADS=$([ "$kind" = tsan ] && echo 1 || echo 2) OPENBLAS_NUM_THREADS=1 \
         "$dir/bin/$t" --gtest_brief=1; then
      failed+=("$t")
    fi
  done
  echo "sanitize: $kind: build $((built - t0)) s, tests $((SECONDS - built)) s"
  if [ ${#failed[@]} -gt 0 ]; then
    echo "sanitize: $kind: FAILED: ${failed[*]}" >&2
    return 1
  fi
}

kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(asan tsan)
status=0
for k in "${kinds[@]}"; do run_one "$k" || status=1; done
exit $status
