#!/usr/bin/env bash
# CPU peer for kdn's prefill and decode speed: llama.cpp's own llama-bench on
# the same GGUF file; and, built beside it, llama.cpp's llama-server, the
# serving peer of bench/serving_peers.py.
#   bench/llama_cpp_peer.sh MODEL.gguf [THREADS] [ARCHIVE_OR_TREE]
#   bench/llama_cpp_peer.sh --build-only [ARCHIVE_OR_TREE]   (prints PREFIX)
# THREADS (default 2) is llama-bench's -t. It runs
#   llama-bench -m MODEL.gguf -t THREADS -p 512,2048 -n 128 -r REPS -o FORMAT
# i.e. prefill (pp512, pp2048: one prompt of that many tokens, in llama-bench's
# default batches, -b 2048 -ub 512) and decode (tg128: 128 tokens one at a time
# from an empty context), each after one warm-up run, REPS times (default 3,
# KDN_LLAMA_BENCH_REPS), printed as tokens/s "average ± stddev" (FORMAT md,
# the default; KDN_LLAMA_BENCH_FORMAT=json|jsonl|csv|sql for the raw records:
# avg_ts, stddev_ts, samples_ts, build_commit, cpu_info, ...). The other test
# parameters are llama-bench's defaults (f16 KV cache, flash attention auto,
# normal priority). Flags checked against this version's
# tools/llama-bench/llama-bench.cpp.
#
# The llama.cpp is the one vendored in the pinned PyPI source archive
# llama-cpp-python 0.3.36 (the same archive, address and digest as
# tests/parity/llama_cpp_refs/build.sh and scripts/install-deps.sh), whose
# CHANGELOG names it ggml-org/llama.cpp@0c1e57098 (version 0.5.0-dev). That
# tree has no .git, so the commit is passed in from the CHANGELOG and the
# build number is 0 (llama-bench prints "build: 0c1e57098 (0)"); without the
# override CMake would ask git, and inside another repository it would report
# that repository's HEAD.
# ARCHIVE_OR_TREE is that archive (.tar.gz, checked against the sha256) or an
# unpacked tree: the llama_cpp_python-0.3.36 folder or its vendor/llama.cpp.
# Without it the archive is downloaded from PyPI into a temporary folder; only
# PyPI is contacted, and only when a build is needed. The build itself fetches
# nothing: CUDA, Vulkan, KleidiAI (ARM), BoringSSL, the server's web UI and
# Windows' OpenMP download are all off or not built here.
# llama-server: PREFIX/bin/llama-server (see bench/serving_peers.py for how it
# is run).
#
# Built once per machine into PREFIX = $KDN_LLAMA_CPP_BENCH or
# ~/.cache/kdn/llama-cpp-bench-0.3.36 (bin/llama-bench, one static binary;
# build-info.txt; LICENSE.llama.cpp). The tests' llama.cpp references are
# built apart (tests/parity/llama_cpp_refs/build.sh): no test needs this.
# kdn-bench prefill/decode --llama-cpp run PREFIX's llama-bench themselves. $PREFIX/.complete holds a digest of the
# archive's sha256, the CMake options below, RECIPE, the compiler and the
# CPU's model and flags; the build is skipped while it matches (a folder
# copied to another CPU is rebuilt, see NATIVE).
# Concurrent calls wait for one another on $PREFIX.lock.
#
# What is built (llama.cpp's CMake, Release, nice, -j KDN_BUILD_JOBS, default 2,
# Ninja when it is installed): the llama-bench and llama-server targets, and
# so only ggml-base, the ggml CPU backend, libllama, llama-common (with
# cpp-httplib, plain HTTP, which llama-bench links for -hf but never uses
# with -m), mtmd and the server's libraries, llama-bench and llama-server.
# The server's web UI is neither built (npm) nor downloaded
# (LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF): it serves the API alone.
# Off: CUDA and every other GPU backend, BLAS (GGML_BLAS=OFF, the
# ggml CPU kernels alone do the matrix products), OpenSSL (LLAMA_OPENSSL=OFF;
# curl is no longer an option of this llama.cpp), tests, examples, server,
# unified app, shared libraries (BUILD_SHARED_LIBS=OFF, so the binaries can be
# copied into PREFIX), ccache (the installed binary is the cache). OpenMP: on,
# llama.cpp's default (GGML_OPENMP, libgomp from GCC), as llama.cpp ships it.
# NATIVE: GGML_NATIVE=ON (llama.cpp's default for a non-cross build), i.e.
# -march=native: this is a peer measured where it is built, and that is how
# llama.cpp is built from source by its users, so it is the strong baseline
# (on an AVX2 machine: its AVX2/FMA/F16C kernels). But AMX: this llama.cpp's
# AMX kernels, which -march=native compiles in where the CPU has amx-int8,
# crash in ggml_backend_amx_mul_mat on the Q4_1 SmolLM2 (SIGSEGV; a Xeon
# with amx_int8 under a hypervisor, 2026-12-06), so they are left out
# (-mno-amx-*) and such a CPU runs ggml's AVX-512 kernels.
# Note that kdn itself is compiled for baseline x86-64 and reaches AVX2 only
# through OpenBLAS's run-time dispatch: a fair comparison names that. The
# digest includes the CPU flags, so the native binary never runs on another CPU.
#
# Build time, measured once: 967 s (16 min) for configure + build, -j2 under
# nice, on this project's 2-core development machine (AMD EPYC, AVX2) while
# kdn's own test suite ran beside it, plus about half a minute for the PyPI
# download (76 MB) and unpacking; 202 s alone on a 2-core Xeon (AVX-512,
# 2026-12-06). The benchmark then takes about 90 s for
# SmolLM2-135M at 2 threads (minutes for multi-billion-parameter models).
# llama-bench names SmolLM2-135M "llama 256M" (its size class by layer
# count); the params column (134.52 M) is the real count.
# Results are only comparable with kdn's when both ran on the same machine,
# with the same thread count, at about the same load.
set -euo pipefail

VERSION=0.3.36
URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${VERSION}.tar.gz"
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PREFIX="${KDN_LLAMA_CPP_BENCH:-${HOME}/.cache/kdn/llama-cpp-bench-${VERSION}}"
JOBS="${KDN_BUILD_JOBS:-2}"
REPS="${KDN_LLAMA_BENCH_REPS:-3}"
FORMAT="${KDN_LLAMA_BENCH_FORMAT:-md}"

say() { echo "llama_cpp_peer: $*" >&2; }
die() { say "$*"; exit 1; }

if [ $# -lt 1 ] || [ $# -gt 3 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
build_only=0
if [ "$1" = "--build-only" ]; then
  build_only=1
  model=""
  threads=2
  src="${2:-}"
else
  model="$1"
  threads="${2:-2}"
  src="${3:-}"
  [ -f "$model" ] || die "no such model file: $model"
fi
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer, not '$threads'"
[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || die "KDN_LLAMA_BENCH_REPS must be a positive integer"
case "$FORMAT" in md|json|jsonl|csv|sql) ;; *) die "KDN_LLAMA_BENCH_FORMAT must be md, json, jsonl, csv or sql";; esac

cpu_id() {
  # The CPU's model and instruction set: what -march=native compiled for.
  grep -m1 '^model name' /proc/cpuinfo 2>/dev/null || true
  grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true
}
# llama.cpp's CMake options (see the header); the commit is added in build().
flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON
  -DGGML_CPU=ON
  -DGGML_CUDA=OFF
  -DGGML_BLAS=OFF
  -DGGML_CCACHE=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_COMMON=ON
  -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_APP=OFF
  "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
)
# What the installed binary depends on: the source, the options, the compiler
# and the CPU (-march=native). Bump RECIPE when build() changes otherwise.
RECIPE=4
stamp=$( { echo "recipe $RECIPE $VERSION $SHA256"; echo "${flags[*]}"; cpu_id
           c++ --version 2>/dev/null | head -1; } | sha256sum | cut -d' ' -f1)

built() {
  [ -f "$PREFIX/.complete" ] && [ "$(cat "$PREFIX/.complete")" = "$stamp" ] &&
    [ -x "$PREFIX/bin/llama-bench" ] && [ -x "$PREFIX/bin/llama-server" ]
}

build() {
  local tmp root lcpp commit gen start secs
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT

  if [ -z "$src" ] || [ -f "$src" ]; then
    if [ -z "$src" ]; then
      say "downloading llama-cpp-python ${VERSION} (PyPI source archive)"
      curl -fsSL --retry 3 -o "$tmp/src.tar.gz" "$URL"
      src="$tmp/src.tar.gz"
    fi
    echo "$SHA256  $src" | sha256sum -c --quiet ||
      die "$src is not llama-cpp-python ${VERSION} (sha256 mismatch)"
    # What the CMake configuration of llama.cpp reads, less models/ and docs/
    # (110 MB of vocabularies and pages), examples/ and tests/ (not built).
    tar xzf "$src" -C "$tmp" --wildcards \
      '*/CHANGELOG.md' '*/llama_cpp/__init__.py' \
      '*/vendor/llama.cpp/CMakeLists.txt' '*/vendor/llama.cpp/LICENSE' \
      '*/vendor/llama.cpp/cmake/*' '*/vendor/llama.cpp/licenses/*' \
      '*/vendor/llama.cpp/include/*' '*/vendor/llama.cpp/src/*' \
      '*/vendor/llama.cpp/ggml/*' '*/vendor/llama.cpp/vendor/*' \
      '*/vendor/llama.cpp/common/*' '*/vendor/llama.cpp/tools/*' \
      '*/vendor/llama.cpp/scripts/ui-assets.cmake'
    root=$(echo "$tmp"/llama_cpp_python-"${VERSION}")
    lcpp="$root/vendor/llama.cpp"
  elif [ -d "$src/vendor/llama.cpp" ]; then
    root="$src"; lcpp="$src/vendor/llama.cpp"
  elif [ -d "$src" ]; then
    lcpp="$src"; root="$src/../.."
  else
    die "no such archive or folder: $src"
  fi
  [ -f "$lcpp/include/llama.h" ] && [ -f "$lcpp/tools/llama-bench/llama-bench.cpp" ] ||
    die "$lcpp is not a llama.cpp tree with tools/llama-bench"
  lcpp=$(cd "$lcpp" && pwd)

  # The tree's version and llama.cpp commit, from llama-cpp-python's own files
  # where they are there (a bare llama.cpp tree is taken on trust).
  if [ -f "$root/llama_cpp/__init__.py" ]; then
    grep -q "__version__ = \"${VERSION}\"" "$root/llama_cpp/__init__.py" ||
      die "$root is not llama-cpp-python ${VERSION}"
  else
    say "warning: cannot check that $lcpp is llama-cpp-python ${VERSION}'s llama.cpp"
  fi
  commit=unknown
  if [ -f "$root/CHANGELOG.md" ]; then
    commit=$(awk -v v="## [${VERSION}]" '
      index($0, v) == 1 { on = 1; next }
      on && /^## \[/ { exit }
      on && match($0, /ggml-org\/llama\.cpp@[0-9a-f]+/) {
        print substr($0, RSTART + 19, RLENGTH - 19); exit }' "$root/CHANGELOG.md")
    [ -n "$commit" ] || commit=unknown
  fi

  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  flags+=(-DLLAMA_BUILD_COMMIT="$commit" -DLLAMA_BUILD_NUMBER=0)
  say "building llama.cpp ${commit} (llama-cpp-python ${VERSION}) llama-bench and llama-server into $PREFIX (-j${JOBS})"
  start=$(date +%s)
  nice cmake -S "$lcpp" -B "$tmp/build" "${gen[@]}" "${flags[@]}" >"$tmp/cmake.log" 2>&1 ||
    { cat "$tmp/cmake.log" >&2; die "cmake configuration failed"; }
  nice cmake --build "$tmp/build" --target llama-bench llama-server -j "$JOBS" \
    >"$tmp/build.log" 2>&1 ||
    { tail -50 "$tmp/build.log" >&2; die "build failed"; }
  secs=$(( $(date +%s) - start ))

  rm -rf "$PREFIX.new"
  mkdir -p "$PREFIX.new/bin"
  cp "$tmp/build/bin/llama-bench" "$tmp/build/bin/llama-server" "$PREFIX.new/bin/"
  cp "$lcpp/LICENSE" "$PREFIX.new/LICENSE.llama.cpp"
  {
    echo "llama-cpp-python ${VERSION} (sha256 ${SHA256})"
    echo "llama.cpp commit ${commit} (from its CHANGELOG)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${secs} s with -j${JOBS} on $(nproc) cores"
    echo "compiler: $(c++ --version | head -1)"
    cpu_id
    echo "cmake ${flags[*]}"
    grep -E 'GGML_(NATIVE|OPENMP|BLAS|AVX|FMA|F16C)|OpenMP|Adding CPU backend|Including CPU' "$tmp/cmake.log" || true
  } >"$PREFIX.new/build-info.txt"
  rm -rf "$PREFIX"
  mv "$PREFIX.new" "$PREFIX"
  echo "$stamp" >"$PREFIX/.complete"
  say "built in ${secs} s"
  rm -rf "$tmp"
  trap - EXIT
}

mkdir -p "$(dirname "$PREFIX")"
if ! built; then
  exec 9>"$PREFIX.lock"
  flock 9
  built || build
  flock -u 9
  exec 9>&-
fi

if [ "$build_only" = 1 ]; then
  echo "$PREFIX"
  exit 0
fi
bench="$PREFIX/bin/llama-bench"
"$bench" --version 2>&1 | sed 's/^/llama_cpp_peer: /' >&2
say "$bench -m $model -t $threads -p 512,2048 -n 128 -r $REPS -o $FORMAT"
exec "$bench" -m "$model" -t "$threads" -p 512,2048 -n 128 -r "$REPS" -o "$FORMAT"
