#!/usr/bin/env bash
# Sets up the opt-in environment of bench/kvpress_peer.py, the reference that
# `kdn-bench prune-fidelity` measures kdn's KV pruning against: NVIDIA's
# kvpress 0.5.5 (Apache-2.0) with the transformers it supports (4.56 to 5.2;
# 5.2.0 here) and torch from PyPI (2.13.0, the CUDA build PyPI carries; it
# runs on the CPU), in a virtual environment of its own. About 6 GB and ten
# minutes the first time; a no-op once done. Usage: scripts/kvpress-env.sh
# [VENV] (default .venv-kvpress at the repository root). Only PyPI is used.
# (pytest: the peer reads SmolLM2 with tests/parity/test_gguf.py's hf_folder.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${KDN_KVPRESS_VENV:-.venv-kvpress}}
KVPRESS_VERSION=0.5.5
if [[ -f "$VENV/.kdn-kvpress-$KVPRESS_VERSION" ]]; then
  echo "kvpress $KVPRESS_VERSION: ready in $VENV"
  exit 0
fi
phase() { echo "[kvpress-env $(date +%T)] $*"; }
phase "virtual environment $VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
phase "installing kvpress $KVPRESS_VERSION, transformers 5.2.0, torch 2.13.0 and what they need"
"$VENV/bin/pip" install --progress-bar off "kvpress==$KVPRESS_VERSION" "transformers==5.2.0" \
  "torch==2.13.0" "gguf==0.17.1" "pytest"
touch "$VENV/.kdn-kvpress-$KVPRESS_VERSION"
phase "done: $(du -sh "$VENV" | cut -f1) in $VENV"
