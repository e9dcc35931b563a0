#!/usr/bin/env bash
# The overcommit case of kdn-bench serve-load (docs/serving.md, "Admission and
# preemption"), in one run: two deployments of the same model side by side,
# one whose decode pool holds half of what the load needs at its longest
# (it preempts) and one whose pool holds all of it, the same load on each.
#
#   bench/overcommit.sh [--model DIR] [--requests 72] [--max-tokens 1000]
#                       [--admission-reserve F] [--json FILE] [BIN_DIR]
#
# The load: --requests concurrent requests, each a document of its own of
# 1,000 characters and a question (about 1,030 tokens on the byte-level
# models/kdn-qa, whose context is 2,048), max_tokens --max-tokens with
# ignore_eos: 72 x 2,030 tokens, 2.2x the overcommitted deployment's decode
# pool of 65,536 tokens (kdn-decode's default); the roomy one's is 1.2x the
# load. Both run --max-batch --requests, and --admission-reserve (the share
# of a decode pool a new request leaves free; default kdn-decode's, 0.01)
# when given. BIN_DIR holds the programs (default build/bin). Prints both
# runs and their ratios; exits 1 if a request failed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
model=$HERE/models/kdn-qa
requests=72
max_tokens=1000
json=""
bin=""
reserve=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    --admission-reserve) reserve=(--decode-admission-reserve "$2"); shift 2 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "overcommit: unknown flag $1 (--help)" >&2; exit 2 ;;
    *) bin=$1; shift ;;
  esac
done
bin=$(cd "${bin:-$HERE/build/bin}" && pwd)
[ -x "$bin/kdn-bench" ] || { echo "overcommit: no kdn-bench in $bin (build first)" >&2; exit 2; }
pool=65536
# 1,100 prompt tokens and max_tokens for each request, with a fifth to spare.
roomy=$(( (requests * (1100 + max_tokens) * 6 / 5 + 15) / 16 * 16 ))
work=$(mktemp -d)
down() {
  for d in tight roomy; do
    [ -d "$work/$d" ] && KDN_BIN_DIR=$bin "$HERE/launch/kdn-launch" down --run-dir "$work/$d" > /dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap down EXIT
up() {  # up NAME POOL_TOKENS: prints the router's URL
  KDN_BIN_DIR=$bin "$HERE/launch/kdn-launch" up --detach --port 0 --run-dir "$work/$1" \
    --model "$model" --threads 1 --max-batch "$requests" --decode-kv-tokens "$2" \
    --disaggregation always "${reserve[@]}" | tail -n 1 | awk '{print $NF}'
}
echo "overcommit: decode pools of $pool tokens (overcommitted) and $roomy (roomy)" >&2
tight_url=$(up tight $pool)
roomy_url=$(up roomy $roomy)
"$bin/kdn-bench" serve-load --overcommit --url "$tight_url" --roomy-url "$roomy_url" \
  --requests "$requests" --doc-chars 1000 --question-chars 24 --max-tokens "$max_tokens" \
  --seed 52 ${json:+--json "$json"}
