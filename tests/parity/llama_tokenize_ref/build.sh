#!/usr/bin/env bash
# Builds llama_tokenize_ref (llama.cpp's own tokenizer, the reference for
# kdn's GGUF tokenizer) from the vendored llama.cpp of the pinned
# llama-cpp-python source archive, once per machine.
#   tests/parity/llama_cpp_tokenize/build.sh [SOURCE]
# SOURCE is that archive (.tar.gz) or an unpacked llama.cpp tree; without it
# the archive is downloaded from PyPI (the address and digest of
# scripts/install-deps.sh) into a temporary folder. The program is installed
# as $PREFIX/bin/llama_tokenize_ref, PREFIX being $KDN_LLAMA_CPP_TOKENIZE or
# ~/.cache/kdn/llama-cpp-tokenize-0.3.36; $PREFIX/.complete holds a digest of
# this folder's files, and the build is skipped while it matches.
# KDN_BUILD_JOBS sets the parallel compile jobs (default: nproc).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

VERSION=0.3.36
URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${VERSION}.tar.gz"
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PREFIX="${KDN_LLAMA_CPP_TOKENIZE:-${HOME}/.cache/kdn/llama-cpp-tokenize-${VERSION}}"

stamp=$(cd "$here" && cat build.sh CMakeLists.txt llama_tokenize_ref.cpp | sha256sum | cut -d' ' -f1)
if [ -f "$PREFIX/.complete" ] && [ "$(cat "$PREFIX/.complete")" = "$stamp" ] &&
   [ -x "$PREFIX/bin/llama_tokenize_ref" ]; then
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

src="${1:-}"
if [ -z "$src" ] || [ -f "$src" ]; then
  if [ -z "$src" ]; then
    echo "llama_cpp_tokenize: downloading llama-cpp-python ${VERSION} (PyPI source archive)"
    curl -fsSL -o "$tmp/src.tar.gz" "$URL"
    src="$tmp/src.tar.gz"
  fi
  echo "$SHA256  $src" | sha256sum -c --quiet
  # Only what libllama and ggml-base are built from.
  tar xzf "$src" -C "$tmp" --wildcards \
    '*/vendor/llama.cpp/CMakeLists.txt' '*/vendor/llama.cpp/LICENSE' '*/vendor/llama.cpp/cmake/*' \
    '*/vendor/llama.cpp/include/*' '*/vendor/llama.cpp/src/*' '*/vendor/llama.cpp/ggml/*' \
    '*/vendor/llama.cpp/vendor/*'
  src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
fi
[ -f "$src/include/llama.h" ] || { echo "llama_cpp_tokenize: $src is not a llama.cpp tree" >&2; exit 1; }

# -O1: the compile takes most of the time, and the tokenizer's speed does not
# matter here.
echo "llama_cpp_tokenize: building llama_tokenize_ref into $PREFIX"
start=$(date +%s)
nice cmake -S "$here" -B "$tmp/build" -G Ninja -DLLAMA_CPP_DIR="$src" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" >"$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log" >&2; exit 1; }
nice cmake --build "$tmp/build" --target llama_tokenize_ref -j "${KDN_BUILD_JOBS:-$(nproc)}" >"$tmp/build.log" 2>&1 ||
  { tail -50 "$tmp/build.log" >&2; exit 1; }

rm -rf "$PREFIX"
mkdir -p "$PREFIX/bin"
cp "$tmp/build/llama_tokenize_ref" "$PREFIX/bin/"
cp "$src/LICENSE" "$PREFIX/LICENSE.llama.cpp"
echo "$stamp" >"$PREFIX/.complete"
echo "llama_cpp_tokenize: built in $(( $(date +%s) - start )) s"
