#!/usr/bin/env bash
# A relocatable binary release of kdn: one tarball that runs from wherever it
# is unpacked, on a machine without a build tree or kdn's build dependencies.
#
#   scripts/package.sh --out FILE.tgz|FILE.tar.xz [--with-cuda-libs]
#
# FILE.tar.xz is about a third the size of FILE.tgz (the programs share the
# CUDA engine's kernels, which xz -9 stores once) and takes a minute longer.
# From build/ (or the build folder KDN_BUILD_DIR names; build it first with
# scripts/build.sh). The tarball holds one folder, kdn/:
#   bin/       the build's programs (the servers, kdn-generate, kdn-bench,
#              kdn-mkmodel, kdn-keygen, ...) and GPU test binaries
#              (kdn_cuda_tests, kdn_kvbus_cuda_tests), their run path set to
#              ../lib, then the CUDA folders they were linked against (patchelf)
#   lib/       the shared libraries they need (ZeroMQ, protobuf, OpenBLAS,
#              spdlog, libstdc++, ...) except the C library and, unless
#              --with-cuda-libs, CUDA's own (libcudart, cuBLAS, NCCL): those
#              come with the CUDA toolkit of the machine, and cuBLAS alone is
#              several hundred MB. The CUDA driver (libcuda) never travels.
#   launch/    kdn-launch (python3, standard library only)
#   python/    the Python package kdn with libkdn_client in kdn/_lib
#              (PYTHONPATH=kdn/python, or pip install kdn/python)
#   models/    the shipped model, models/kdn-qa
#   scripts/   gpu-check.sh with what it runs (gpu-figures.py,
#              request-phases.py), fetch-smollm2.sh
#   bench/     hf_peer.py (gpu-check.sh --profile full's transformers peer)
#   docs/engine.md  the "Owed on a GPU" table that gpu-check.sh --profile quick reads
# Then, in any folder:
#   tar xzf FILE.tgz && kdn/launch/kdn-launch up          # serves models/kdn-qa
#   kdn/scripts/gpu-check.sh --profile quick              # on a GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
out="" cuda_libs=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:-}; shift 2 || true ;;
    --with-cuda-libs) cuda_libs=1; shift ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "package: unknown argument '$1' (--out FILE.tgz [--with-cuda-libs])" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "package: --out FILE.tgz is required" >&2; exit 2; }
build=${KDN_BUILD_DIR:-build}
[ -x "$build/bin/kdn-router" ] || {
  echo "package: no $build/bin/kdn-router: build first (scripts/build.sh) or set KDN_BUILD_DIR" >&2; exit 1; }
command -v patchelf >/dev/null || {
  echo "package: needs patchelf (apt-get install patchelf)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/kdn
mkdir -p "$root/bin" "$root/lib" "$root/scripts" "$root/docs" "$root/bench" "$root/models"
# The C runtime stays the machine's; so does the CUDA driver, and CUDA's own
# libraries unless asked for.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libresolv\.so|libcuda\.so|libnvidia)'
cuda='^(libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvJitLink|libcurand|libcusparse|libcusolver|libcufft)'
n=0
# The programs (kdn-*) and the GPU tests (kdn_*cuda*); not the CPU unit
# tests or the fuzz harnesses, which belong to the source tree's ctest.
for p in "$build"/bin/kdn-* "$build"/bin/kdn_*cuda*; do
  [ -f "$p" ] && [ -x "$p" ] || continue
  cp -L "$p" "$root/bin/"
  n=$((n + 1))
  while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [[ $cuda_libs = 0 && $name =~ $cuda ]] && continue
    [ -f "$path" ] || { echo "package: $(basename "$p") needs $name, which ldd does not find" >&2; exit 1; }
    [ -f "$root/lib/$name" ] || cp -L "$path" "$root/lib/$name"
  done < <(ldd "$p" | awk '/=>/ {print $1, $3}')
done
# The run path: lib/ first, then the CUDA folders the build linked against
# (where the machine's toolkit is at the same place, as under
# /usr/local/cuda); nothing of the build tree.
src=$(pwd -P)
for p in "$root"/bin/*; do
  [ "$(head -c 4 "$p" | tail -c 3)" = ELF ] || continue
  rpath='$ORIGIN/../lib'
  IFS=: read -r -a old <<< "$(patchelf --print-rpath "$p")"
  for d in "${old[@]}"; do
    case "$d" in ""|"$src"/*|"$(cd "$build" && pwd -P)"/*|'$ORIGIN'*) ;; *) rpath="$rpath:$d" ;; esac
  done
  patchelf --set-rpath "$rpath" "$p"
done
for l in "$root"/lib/*; do patchelf --set-rpath '$ORIGIN' "$l" 2>/dev/null || true; done

# The client library inside the Python package `kdn` (docs/clients.md),
# which finds it there; what it links is in lib/ with the programs'.
if [ -f "$build/lib/libkdn_client.so.2" ]; then
  mkdir -p "$root/python/kdn/_lib"
  cp python/pyproject.toml "$root/python/"
  cp python/kdn/*.py "$root/python/kdn/"
  cp -L "$build/lib/libkdn_client.so.2" "$root/python/kdn/_lib/"
  while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [ -f "$root/lib/$name" ] || cp -L "$path" "$root/lib/$name"
  done < <(ldd "$build/lib/libkdn_client.so.2" | awk '/=>/ {print $1, $3}')
  patchelf --set-rpath '$ORIGIN/../../../lib' "$root/python/kdn/_lib/libkdn_client.so.2"
fi

cp -r launch "$root/"
find "$root/launch" -name __pycache__ -prune -exec rm -rf {} +
cp -r models/kdn-qa "$root/models/"
cp scripts/gpu-check.sh scripts/gpu-figures.py scripts/request-phases.py scripts/fetch-smollm2.sh \
  "$root/scripts/"
cp bench/hf_peer.py "$root/bench/"
cp docs/engine.md "$root/docs/"
echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)" \
  > "$root/VERSION"
mkdir -p "$(dirname "$out")"
case "$out" in
  # xz -9's 64 MiB window finds the CUDA kernels every program carries (the
  # engine is linked into each): a third of gzip's size, a minute to pack.
  *.tar.xz|*.txz) tar cf - -C "$stage" kdn | xz -9 -T1 > "$out" ;;
  *) tar czf "$out" -C "$stage" kdn ;;
esac
echo "package: $out ($(du -h "$out" | cut -f1)): $n programs, $(ls "$root/lib" | wc -l) libraries$(
  [ $cuda_libs = 1 ] && echo ", CUDA's included" || echo ", CUDA's from the machine"), kdn $(cat "$root/VERSION")"
