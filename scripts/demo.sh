#!/usr/bin/env bash
# The main job, for now: install, build, generate the `small` model (16 layers,
# ~47M parameters, deterministic from its seed) and run the engine on a prompt.
# Generated weights are random, so the text is noise; the timings are real.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DKDN_BUILD_TESTS=OFF
model=models/generated/small
if [ ! -f "$model/model.safetensors" ]; then
  build/bin/kdn-mkmodel --preset small --seed 0 --out "$model"
fi
echo "demo: generated weights are random, so the continuation below is noise; the timings are real"
build/bin/kdn-generate --model "$model" --max-tokens 48 \
  --prompt "${1:-The key-value cache of a document is computed once and reused by every prompt that contains it.}"
