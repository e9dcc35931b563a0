#!/usr/bin/env bash
# Builds llama.cpp's reference programs of kdn's tests (CMakeLists.txt
# beside this: llama_tokenize_ref and llama_logits_ref) from the vendored
# llama.cpp of the pinned llama-cpp-python source archive, once per machine.
#   tests/parity/llama_cpp_refs/build.sh [SOURCE]
# SOURCE is that archive (.tar.gz) or an unpacked llama.cpp tree; without it
# the archive is downloaded from PyPI (the address and digest of
# scripts/install-deps.sh) into a temporary folder. The programs go to
# $PREFIX/bin, PREFIX being $KDN_LLAMA_CPP_REFS or
# ~/.cache/kdn/llama-cpp-refs-0.3.36; $PREFIX/.complete holds a digest of
# this folder's files, the compiler and the CPU's model and flags (the CPU
# backend is compiled for this CPU), and the build is skipped while it
# matches. KDN_BUILD_JOBS sets the parallel compile jobs (default: nproc).
#
# AMX: this llama.cpp's AMX kernels (ggml-cpu/amx, compiled in when
# -march=native finds amx-int8) crash in ggml_backend_amx_mul_mat on the
# Q4_1 SmolLM2 (SIGSEGV, 2026-12-06, a Xeon with amx_int8 under a
# hypervisor), so they are left out (-mno-amx-*): the CPU backend then uses
# its AVX-512 or AVX2 kernels, as on a CPU without AMX.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

VERSION=0.3.36
URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${VERSION}.tar.gz"
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PREFIX="${KDN_LLAMA_CPP_REFS:-${HOME}/.cache/kdn/llama-cpp-refs-${VERSION}}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

stamp=$( { cd "$here" && cat build.sh CMakeLists.txt llama_tokenize_ref.cpp llama_logits_ref.cpp
           c++ --version 2>/dev/null | head -1
           grep -m1 '^model name' /proc/cpuinfo 2>/dev/null || true
           grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)
if [ -f "$PREFIX/.complete" ] && [ "$(cat "$PREFIX/.complete")" = "$stamp" ] &&
   [ -x "$PREFIX/bin/llama_tokenize_ref" ] && [ -x "$PREFIX/bin/llama_logits_ref" ]; then
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

src="${1:-}"
if [ -z "$src" ] || [ -f "$src" ]; then
  if [ -z "$src" ]; then
    echo "llama_cpp_refs: downloading llama-cpp-python ${VERSION} (PyPI source archive)"
    curl -fsSL --retry 3 -o "$tmp/src.tar.gz" "$URL"
    src="$tmp/src.tar.gz"
  fi
  echo "$SHA256  $src" | sha256sum -c --quiet
  # Only what libllama and ggml (base and CPU backend) are built from.
  tar xzf "$src" -C "$tmp" --wildcards \
    '*/vendor/llama.cpp/CMakeLists.txt' '*/vendor/llama.cpp/LICENSE' '*/vendor/llama.cpp/cmake/*' \
    '*/vendor/llama.cpp/include/*' '*/vendor/llama.cpp/src/*' '*/vendor/llama.cpp/ggml/*' \
    '*/vendor/llama.cpp/vendor/*'
  src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
fi
[ -f "$src/include/llama.h" ] || { echo "llama_cpp_refs: $src is not a llama.cpp tree" >&2; exit 1; }

echo "llama_cpp_refs: building llama_tokenize_ref and llama_logits_ref into $PREFIX"
start=$(date +%s)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
nice cmake -S "$here" -B "$tmp/build" "${gen[@]}" -DLLAMA_CPP_DIR="$src" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  >"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log" >&2; exit 1; }
nice cmake --build "$tmp/build" --target llama_tokenize_ref llama_logits_ref \
  -j "${KDN_BUILD_JOBS:-$(nproc)}" >"$tmp/build.log" 2>&1 ||
  { tail -50 "$tmp/build.log" >&2; exit 1; }

rm -rf "$PREFIX"
mkdir -p "$PREFIX/bin"
cp "$tmp/build/llama_tokenize_ref" "$tmp/build/llama_logits_ref" "$PREFIX/bin/"
cp "$src/LICENSE" "$PREFIX/LICENSE.llama.cpp"
grep -E 'Adding CPU backend|Including CPU|OpenMP' "$tmp/cmake.log" >"$PREFIX/build-info.txt" || true
echo "$stamp" >"$PREFIX/.complete"
echo "llama_cpp_refs: built in $(( $(date +%s) - start )) s"
