#!/usr/bin/env bash
# Reproduces models/kdn-qa: eval set, training, export, evaluation, checks.
#   bash tools/train/train.sh [OUT_RUN_DIR]     (from the repository root)
# Env: PY (default .venv-ref/bin/python), THREADS (2), STEPS (500), RESUME=1 to
# continue an interrupted run from its checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv-ref/bin/python}
RUN=${1:-/tmp/kdn-qa-run}
THREADS=${THREADS:-2}
STEPS=${STEPS:-500}
DEST=models/kdn-qa
mkdir -p "$DEST"
"$PY" tools/train/corpus.py --seed 1 --split eval --count 300 --out "$DEST/eval.jsonl"
OMP_WAIT_POLICY=PASSIVE "$PY" tools/train/train.py --out "$RUN" --export "$DEST" \
  --steps "$STEPS" --seed 0 --threads "$THREADS" ${RESUME:+--resume} \
  --hidden 64 --ffn 256 --layers 12 --heads 4 --kv-heads 2 \
  --examples 6 --micro 2 --max-questions 8 --short-frac 0.4 \
  --lr 4e-3 --warmup 40 --probe-every 50 --probe-size 32 --ckpt-every 25
"$PY" tools/train/evaluate.py --model "$DEST" --threads "$THREADS" --json "$RUN/scores.json"
"$PY" tools/train/verify_hf.py --model "$DEST" --threads "$THREADS"
"$PY" tools/train/demo.py --model "$DEST" --out "$DEST/demo.json"
if [ -x build/bin/kdn-generate ]; then
  "$PY" tools/train/demo.py --model "$DEST" --check-kdn build/bin/kdn-generate
fi
