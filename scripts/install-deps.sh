#!/usr/bin/env bash
# Installs what kdn needs to build and run, from Debian's packages.
#   scripts/install-deps.sh          build dependencies only
#   scripts/install-deps.sh --ref-packages   the Debian packages of --ref
#                                    alone (no PyPI, no llama.cpp, no model)
#   scripts/install-deps.sh --ref    also the test references: Debian's CPU
#                                    PyTorch and, in .venv-ref/, the pinned
#                                    PyPI packages of tests/parity/requirements.txt,
#                                    the real vocabularies and chat templates
#                                    of one pinned PyPI source archive (below),
#                                    llama.cpp's tokenizer and logits
#                                    references built from it
#                                    (tests/parity/llama_cpp_refs/), and
#                                    a real pretrained model, SmolLM2-135M-Instruct
#                                    as GGUF (scripts/fetch-smollm2.sh)
# Where nvcc is present it also fetches the FlashInfer attention headers: one
# pinned wheel from PyPI, unpacked to ~/.cache/kdn (KDN_FLASHINFER_DIR in
# CMake). Nothing else is downloaded. CUDA (nvcc, cuBLAS, NCCL) is expected
# under /usr/local/cuda where present; without it the build is CPU-only.
set -euo pipefail
cd "$(dirname "$0")/.."

want_ref=0 want_ref_python=1
case "${1:-}" in
  --ref) want_ref=1 ;;
  # The packages of --ref alone (Debian's, FlashInfer's headers): what a
  # build needs; the Python references can come beside it (scripts/test.sh).
  --ref-packages) want_ref=1 want_ref_python=0 ;;
  "") ;;
  *) echo "install-deps: unknown argument '$1' (--ref, --ref-packages)" >&2; exit 2 ;;
esac

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# timed WHAT COMMAND...: runs COMMAND between a line saying what it does and
# one saying how long it took (progress for an install of many minutes).
timed() {
  local what=$1 t0=$SECONDS
  shift
  echo "install-deps: $what ..."
  "$@"
  echo "install-deps: $what: done in $((SECONDS - t0)) s"
}

pkgs=(build-essential cmake ninja-build ccache pkg-config
      libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libxxhash-dev
      libzmq3-dev cppzmq-dev libprotobuf-dev protobuf-compiler libboost-dev libzstd-dev
      libspdlog-dev libfmt-dev libpcre2-dev libutf8proc-dev
      # redis-server: `kdn-launch up --redis-cluster` and the Redis tests;
      # libhiredis-dev: the workers' Redis client.
      redis-server libhiredis-dev
      # base-files: /usr/share/common-licenses, the English prose of
      # kdn-bench blend-fidelity and of the demo (essential, so normally
      # present already).
      base-files
      # python3-pip: scripts/fetch-smollm2.sh downloads the demo's model wheel.
      python3-pip)
if [ $want_ref = 1 ]; then
  # promtool (package prometheus) checks /metrics; curl speaks SSE to the router.
  # munge, slurmctld, slurmd and slurm-client: a throwaway Slurm for tests/slurm.
  # clang-14 and libclang-rt-14-dev: libFuzzer, for the fuzz tests;
  # libomp-14-dev: clang's omp.h, which the CPU engine includes there.
  # clang-format-14: scripts/format.sh and scripts/check-format.sh.
  # patchelf: scripts/package.sh (the release's run paths), tested in tests/deploy.
  # chromium (headless) and fonts-liberation: the router's status page in a
  # real browser (tests/deploy/test_status_page.py).
  pkgs+=(python3 python3-venv python3-pip python3-torch python3-numpy prometheus curl
        munge slurmctld slurmd slurm-client clang-14 libclang-rt-14-dev libomp-14-dev
        clang-format-14 patchelf chromium fonts-liberation)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  timed "apt-get update" $SUDO apt-get update -qq
  timed "apt-get install ${missing[*]}" $SUDO env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ $want_ref = 1 ] && [ $want_ref_python = 1 ]; then
  # Debian's python3 (its torch is built for it), with the pinned references
  # in a venv that sees the system site-packages.
  if [ ! -x .venv-ref/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv-ref
  fi
  if ! .venv-ref/bin/python -c "import transformers, tokenizers, pytest" 2>/dev/null ||
     ! cmp -s tests/parity/requirements.txt .venv-ref/requirements.installed; then
    timed "pip install -r tests/parity/requirements.txt (into .venv-ref)" \
      .venv-ref/bin/pip install -q --disable-pip-version-check -r tests/parity/requirements.txt
    cp tests/parity/requirements.txt .venv-ref/requirements.installed
  fi
  # Real tokenizer vocabularies (Llama 3, Llama 2/Mistral sentencepiece, Qwen2,
  # GPT-2, as GGUF files with the ids Hugging Face gave for test inputs) and
  # real chat templates: llama.cpp's test data, inside the pinned
  # llama-cpp-python source archive. Only those files are unpacked, to
  # ~/.cache/kdn (KDN_LLAMA_CPP_REF in CMake).
  LLAMA_CPP_PY_VERSION=0.3.36
  LLAMA_CPP_REF="${HOME}/.cache/kdn/llama-cpp-python-${LLAMA_CPP_PY_VERSION}"
  if [ ! -f "$LLAMA_CPP_REF/.complete" ]; then
    echo "install-deps: llama-cpp-python ${LLAMA_CPP_PY_VERSION} vocabularies and templates into $LLAMA_CPP_REF"
    tmp=$(mktemp -d)
    # The archive's PyPI address and digest (pip download would build the
    # package's metadata, and with it a C++ toolchain's worth of build deps).
    curl -fsSL -o "$tmp/src.tar.gz" \
      "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${LLAMA_CPP_PY_VERSION}.tar.gz"
    echo "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  $tmp/src.tar.gz" | sha256sum -c --quiet
    tar xzf "$tmp/src.tar.gz" -C "$tmp" --wildcards \
      '*/vendor/llama.cpp/models/ggml-vocab-*' '*/vendor/llama.cpp/models/templates/*'
    rm -rf "$LLAMA_CPP_REF"
    mkdir -p "$(dirname "$LLAMA_CPP_REF")"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp/models "$LLAMA_CPP_REF"
    touch "$LLAMA_CPP_REF/.complete"
    archive="$tmp/src.tar.gz"  # the same archive serves the build below
  fi
  # llama.cpp's own tokenizer and logits (llama_tokenize_ref,
  # llama_logits_ref), built from that archive's llama.cpp (libllama and the
  # ggml CPU backend) into ~/.cache/kdn (KDN_LLAMA_CPP_REFS): the references
  # for kdn's GGUF tokenizer and its quantized CPU engine. Built once (about
  # 4 minutes at -j2); this returns at once while the build is current, and
  # downloads the archive again when it is not and none was just fetched.
  # (llama-bench, kdn-bench's speed peer, is built when a benchmark asks:
  # bench/llama_cpp_peer.sh.)
  timed "llama.cpp's tokenizer and logits references (built once)" \
    tests/parity/llama_cpp_refs/build.sh ${archive:+"$archive"}
  [ -z "${tmp:-}" ] || rm -rf "$tmp"
  timed "SmolLM2-135M-Instruct" scripts/fetch-smollm2.sh .venv-ref/bin/python
fi

# FlashInfer's headers (with the CUTLASS and CCCL headers they need), for the
# CUDA engine's attention: the pinned wheel is only unpacked, never installed.
FLASHINFER_VERSION=0.7.2.post1
FLASHINFER_DIR="${HOME}/.cache/kdn/flashinfer-${FLASHINFER_VERSION}"
if [ -x /usr/local/cuda/bin/nvcc ] && [ ! -f "$FLASHINFER_DIR/.complete" ]; then
  echo "install-deps: FlashInfer ${FLASHINFER_VERSION} headers into $FLASHINFER_DIR"
  command -v unzip >/dev/null || { $SUDO apt-get update -qq; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq unzip; }
  python3 -m pip --version >/dev/null 2>&1 || { $SUDO apt-get update -qq; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-pip; }
  tmp=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps \
    "flashinfer-python==${FLASHINFER_VERSION}" -d "$tmp"
  unzip -q "$tmp"/flashinfer_python-*.whl 'flashinfer/data/include/*' 'flashinfer/data/cutlass/include/*' \
    'flashinfer/data/cutlass/tools/util/include/*' \
    'flashinfer/data/cccl/libcudacxx/include/*' 'flashinfer/data/cccl/cub/cub/*' \
    'flashinfer/data/cccl/thrust/thrust/*' -d "$tmp/x"
  mkdir -p "$(dirname "$FLASHINFER_DIR")"
  rm -rf "$FLASHINFER_DIR"
  mv "$tmp/x/flashinfer/data" "$FLASHINFER_DIR"
  touch "$FLASHINFER_DIR/.complete"
  rm -rf "$tmp"
fi
