#!/usr/bin/env bash
# Reproduces models/kdn-qa: eval set, training, export, evaluation, checks.
#   bash tools/train/train.sh [OUT_RUN_DIR]     (from the repository root)
# Env: PY (default .venv-train/bin/python, made here from requirements.txt),
# THREADS (2), STEPS (4000), RESUME=1 to continue an interrupted run from its
# checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then
  PY=.venv-train/bin/python
  if ! cmp -s tools/train/requirements.txt .venv-train/requirements.installed; then
    python3 -m venv .venv-train
    .venv-train/bin/pip install -q --disable-pip-version-check -r tools/train/requirements.txt
    cp tools/train/requirements.txt .venv-train/requirements.installed
  fi
fi
RUN=${1:-/tmp/kdn-qa-run}
THREADS=${THREADS:-2}
STEPS=${STEPS:-4000}
DEST=models/kdn-qa
mkdir -p "$DEST"
"$PY" tools/train/corpus.py --seed 1 --split eval --count 300 --out "$DEST/eval.jsonl"
"$PY" tools/train/train.py --out "$RUN" --export "$DEST" \
  --steps "$STEPS" --seed 0 --threads "$THREADS" ${RESUME:+--resume} \
  --hidden 64 --ffn 256 --layers 12 --heads 4 --kv-heads 2 \
  --examples 4 --micro 1 --max-questions 8 --short-frac 0.1 --short-docs 3 \
  --copy-frac 0.2 --copy-share 0.7 \
  --lr 3e-3 --warmup 100 --probe-every 200 --probe-size 32 --ckpt-every 100 --log-seconds 60
"$PY" tools/train/evaluate.py --model "$DEST" --threads "$THREADS" --json "$RUN/scores.json"
"$PY" tools/train/verify_hf.py --model "$DEST" --threads "$THREADS"
"$PY" tools/train/demo.py --model "$DEST" --out "$DEST/demo.json"
if [ -x build/bin/kdn-generate ]; then
  "$PY" tools/train/demo.py --model "$DEST" --check-kdn build/bin/kdn-generate
fi
