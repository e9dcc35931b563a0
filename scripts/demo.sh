#!/usr/bin/env bash
# The main job: install, build, and run a local disaggregated deployment
# (kdn-router, one kdn-prefill and one kdn-decode worker) on the shipped
# question-answering model `models/kdn-qa` (tools/train/), send it questions
# about documents through the OpenAI-compatible API (then the same documents
# in another order, blended from the KDN), and stop it. `launch/kdn-launch up`
# keeps a deployment running instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DKDN_BUILD_TESTS=OFF
exec launch/kdn-launch demo --port 0 "$@"
