#!/usr/bin/env bash
# Reproduces models/kdn-qa: eval sets, training, export, evaluation, checks.
#   bash tools/train/train.sh [--device cpu|cuda] [OUT_RUN_DIR]   (from the repository root)
# --device cuda: 12,000 steps of 128 examples, about 20 minutes on one H100
# (10 steps/s). The shipped model is this recipe's first 856 steps of a
# 900-step schedule (STEPS=900 STOP_STEP=856 WARMUP=100; models/kdn-qa/README.md).
# --device cpu (the default): the same model, 4,000 steps of 8 examples
# (2.5 s a step on 2 cores with Debian's PyTorch 1.13, so under 3 hours).
# Env: PY (default .venv-train/bin/python, made here from requirements.txt;
# on a machine that already has PyTorch with CUDA, PY=python3), THREADS (2),
# STEPS (the device's default), STOP_STEP (stop there under STEPS' schedule),
# WARMUP (200), WORKERS (batch-making processes), RESUME=1 to
# continue an interrupted run from its checkpoint, MAX_MINUTES to stop (checkpointed
# and exported) after that much training time.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE=cpu
RUN=/tmp/kdn-qa-run
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs cpu or cuda}; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "train.sh: unknown option $1" >&2; exit 2 ;;
    *) RUN=$1; shift ;;
  esac
done
case "$DEVICE" in
  cpu) STEPS=${STEPS:-4000}; WORKERS=${WORKERS:-0}; EXAMPLES=8; PROBE_EVERY=500 ;;
  cuda) STEPS=${STEPS:-12000}; WORKERS=${WORKERS:-8}; EXAMPLES=128; PROBE_EVERY=1000 ;;
  *) echo "train.sh: --device must be cpu or cuda, not $DEVICE" >&2; exit 2 ;;
esac
if [ -z "${PY:-}" ]; then
  PY=.venv-train/bin/python
  if ! cmp -s tools/train/requirements.txt .venv-train/requirements.installed; then
    python3 -m venv .venv-train
    .venv-train/bin/pip install -q --disable-pip-version-check -r tools/train/requirements.txt
    cp tools/train/requirements.txt .venv-train/requirements.installed
  fi
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "train.sh: --device cuda, but $PY's PyTorch sees no CUDA device" >&2
  exit 1
fi
THREADS=${THREADS:-2}
DEST=models/kdn-qa
mkdir -p "$DEST"
"$PY" tools/train/corpus.py --seed 1 --split eval --count 300 --out "$DEST/eval.jsonl"
"$PY" tools/train/corpus.py --seed 2 --split eval --phrasing novel --count 150 \
  --out "$DEST/eval-phrasing.jsonl"
"$PY" tools/train/train.py --out "$RUN" --export "$DEST" --device "$DEVICE" \
  --steps "$STEPS" --seed 0 --threads "$THREADS" --workers "$WORKERS" ${RESUME:+--resume} \
  --hidden 192 --ffn 768 --layers 8 --heads 6 --kv-heads 2 \
  --examples "$EXAMPLES" --micro 2 --pad-to 32 --max-questions 8 \
  --short-frac 0.05 --short-docs 3 --copy-frac 0.1 --copy-share 0.7 --coref-share 0.4 \
  --lr 2e-3 --warmup "${WARMUP:-200}" --stop-step "${STOP_STEP:-0}" --probe-every "$PROBE_EVERY" --probe-size 96 --ckpt-every 500 \
  --log-seconds 30 --max-minutes "${MAX_MINUTES:-0}"
for set in eval eval-phrasing; do
  "$PY" tools/train/evaluate.py --model "$DEST" --eval "$DEST/$set.jsonl" --device "$DEVICE" \
    --threads "$THREADS" --json "$RUN/scores-$set.json"
done
"$PY" tools/train/verify_hf.py --model "$DEST" --threads "$THREADS"
"$PY" tools/train/demo.py --model "$DEST" --out "$DEST/demo.json"
if [ -x build/bin/kdn-generate ]; then
  "$PY" tools/train/demo.py --model "$DEST" --check-kdn build/bin/kdn-generate
fi
