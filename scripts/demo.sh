#!/usr/bin/env bash
# The main job: install, build, and run a local disaggregated deployment
# (kdn-router, one kdn-prefill and one kdn-decode worker) on the generated
# `small` model (16 layers, ~47M parameters, deterministic from its seed),
# send it sample requests through the OpenAI-compatible API, and stop it.
# Generated weights are random, so the text is noise; timings and cache hits
# are real. `launch/kdn-launch up` keeps a deployment running instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DKDN_BUILD_TESTS=OFF
exec launch/kdn-launch demo --port 0 "$@"
