#!/usr/bin/env bash
# C++ unit tests (gtest binaries of tests/CMakeLists.txt) under the
# sanitizers, each in a build of its own with only what those tests need
# (no CUDA, no kdn-bench, no deployment tests):
#   asan   AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer, in
#          build-asan/: the tree compiled once with clang (with libFuzzer's
#          coverage instrumentation and Clang's thread-safety analysis), for
#          the unit tests and the libFuzzer harnesses (tests/fuzz, KDN_FUZZ),
#          whose fuzz tests (ctest label fuzz) run after the unit tests
#   tsan   ThreadSanitizer, in build-tsan/
# Any report fails the run: every sanitizer halts on its first error
# (-fno-sanitize-recover=all, halt_on_error=1) and the test binary exits
# non-zero. scripts/test.sh runs both after the main ctest; CI runs that.
#
#   scripts/sanitize.sh            both
#   scripts/sanitize.sh tsan       one
#   scripts/sanitize.sh --build-only [asan|tsan]   configure and build, run nothing
# Extra cmake arguments can come in $KDN_SANITIZE_CMAKE_ARGS.
# Warnings are the main build's business (-Werror there), not these builds',
# but for Clang's thread-safety analysis, whose findings fail the asan build.
# Suppressions (scripts/sanitize/tsan.supp) name third-party code only, each
# with its reason.
#
# Under TSan, OpenMP and OpenBLAS run on one thread: libgomp is not built with
# TSan, so its barriers would be reported as races that are not there.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache's hashes hold paths relative to the clone, so that a clone in another
# folder (CI's) finds what an earlier one compiled.
export CCACHE_BASEDIR="$PWD"

# The binaries each sanitizer runs. ASan+UBSan runs every unit-test binary;
# TSan those whose code runs threads: the kvbus transports and kdn-store's
# server and client (kdn_kvbus_tests), the Redis tier's connection pool and
# slot map (kdn_redis_tests), the control socket (kdn_control_tests), the
# prefill worker's service with its KV I/O and store threads
# (kdn_prefill_worker_tests), the router's backend and request flow
# (kdn_router_tests), and the decode worker's service, decoder and batcher
# with their store I/O thread (kdn_decode_worker_tests). The others (model,
# text, engine, kvbridge, blend) compute on the calling thread or in OpenMP
# loops.
ASAN_TESTS=(kdn_common_tests kdn_model_tests kdn_text_tests kdn_engine_tests kdn_kvbus_tests
            kdn_kvbridge_tests kdn_decode_worker_tests kdn_blend_tests kdn_control_tests
            kdn_prefill_worker_tests kdn_router_tests kdn_redis_tests kdn_client_tests
            kdn_prune_tests kdn_worker_tests)
TSAN_TESTS=(kdn_common_tests kdn_kvbus_tests kdn_redis_tests kdn_control_tests
            kdn_prefill_worker_tests kdn_router_tests kdn_decode_worker_tests)
SUPP="$PWD/scripts/sanitize"

run_one() {
  local kind=$1 flags dir=build-$1 tests targets compilers=()
  case "$kind" in
    asan)
      # clang: libFuzzer and the thread-safety analysis come with it.
      local cc=${KDN_CLANG:-clang-14} cxx=${KDN_CLANGXX:-clang++-14}
      command -v "$cxx" >/dev/null || {
        echo "sanitize: $cxx is missing (scripts/install-deps.sh --ref installs it)" >&2; return 1; }
      compilers=(-DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DKDN_FUZZ=ON)
      flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fsanitize=fuzzer-no-link"
      tests=("${ASAN_TESTS[@]}") targets=("${ASAN_TESTS[@]}" kdn_fuzzers kdn-store) ;;
    tsan) flags="-fsanitize=thread" tests=("${TSAN_TESTS[@]}") targets=("${TSAN_TESTS[@]}") ;;
    *) echo "sanitize: unknown sanitizer '$kind' (asan or tsan)" >&2; return 2 ;;
  esac
  # Line tables are all a report's stacks need, and cost a fraction of -g.
  # Their paths are relative to the clone (-fdebug-prefix-map): ccache then
  # leaves the build folder out of its hashes, and serves these compiles to
  # a clone in another folder.
  flags="-O1 -fno-omit-frame-pointer -fdebug-prefix-map=$PWD=. $flags"
  case "$kind" in
    asan) flags="$flags -gline-tables-only" ;;
    # -Wno-tsan: GCC says, for Boost.Asio's fenced blocks, that TSan does not
    # model atomic_thread_fence; no test here runs Asio's handlers.
    tsan) flags="$flags -g1 -Wno-tsan" ;;
  esac
  local t0=$SECONDS
  mkdir -p "$dir"
  # Unity builds (each target's sources compiled in batches of up to 8, one
  # translation unit each): most of these builds' time is the same heavy
  # headers parsed again per source, and nothing here is rebuilt file by file.
  # With CMake 4 the batches include their sources by paths relative to the
  # clone (CMAKE_UNITY_BUILD_RELOCATABLE), so that a clone in another folder
  # finds these compiles in ccache too; CMake 3 writes absolute paths.
  local unity=(-DCMAKE_UNITY_BUILD=ON)
  [ "$CMAKE_MAJOR" -ge 4 ] && unity+=(-DCMAKE_UNITY_BUILD_RELOCATABLE=ON)
  # shellcheck disable=SC2086
  "$CMAKE" -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Sanitize -DKDN_CUDA=OFF \
    -DKDN_BUILD_TESTS=ON -DKDN_BUILD_BENCH=OFF -DKDN_REF_PYTHON= -DKDN_WERROR=OFF \
    "${unity[@]}" \
    "${compilers[@]}" \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" \
    ${KDN_SANITIZE_CMAKE_ARGS:-} >"$dir/configure.log" 2>&1 || {
    cat "$dir/configure.log"; return 1; }
  "$CMAKE" --build "$dir" -j "$(nproc)" --target "${targets[@]}" || return 1
  [ "$build_only" = 1 ] && { echo "sanitize: $kind: built in $((SECONDS - t0)) s"; return 0; }
  local built=$SECONDS failed=()
  local t1
  for t in "${tests[@]}"; do
    echo "sanitize: $kind $t"
    t1=$SECONDS
    if ! ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=1" \
         UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
         TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp" \
         OMP_NUM_THREADS=$([ "$kind" = tsan ] && echo 1 || echo 2) OPENBLAS_NUM_THREADS=1 \
         KDN_BIN_DIR="$dir/bin" \
         "$dir/bin/$t" --gtest_brief=1; then
      failed+=("$t")
    fi
    echo "sanitize: $kind $t: $((SECONDS - t1)) s"
  done
  if [ "$kind" = asan ]; then
    echo "sanitize: asan: the fuzz tests (ctest -L fuzz)"
    (cd "$dir" && OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ctest -L fuzz --output-on-failure -j "$(nproc)") ||
      failed+=(fuzz)
  fi
  echo "sanitize: $kind: build $((built - t0)) s, tests $((SECONDS - built)) s"
  if [ ${#failed[@]} -gt 0 ]; then
    echo "sanitize: $kind: FAILED: ${failed[*]}" >&2
    return 1
  fi
}

# The CMake: $KDN_CMAKE, else the CMake 4 that scripts/install-deps.sh --ref
# puts in .venv-ref (PyPI's), else Debian's.
CMAKE=cmake
for c in "${KDN_CMAKE:-}" .venv-ref/bin/cmake; do
  if [ -n "$c" ] && [ -x "$c" ]; then CMAKE=$c; break; fi
done
CMAKE_MAJOR=$("$CMAKE" --version | sed -n '1s/^cmake version \([0-9]*\).*/\1/p')
[ -n "$CMAKE_MAJOR" ] || { echo "sanitize: cannot tell $CMAKE's version" >&2; exit 1; }

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(asan tsan)
status=0
for k in "${kinds[@]}"; do run_one "$k" || status=1; done
exit $status
