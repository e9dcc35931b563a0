#!/usr/bin/env bash
# What a GPU machine runs for the CUDA backend (docs/engine.md, "The CUDA
# backend") and the deployment on GPUs (docs/serving.md, "GPUs"): the
# gpu-labelled tests, the whole deployment on one GPU (tests/deploy/test_gpu.py),
# the transformers peer, the prefill/decode benchmarks on the llama3-8b shape
# with their ratios to the hardware and to the peer (decode also at batch 32
# with 4,096 tokens of context), multiturn at a 16K-token context (with the
# decode worker's local prefill beside the prefill worker's logic) and
# rag-blend with 8 documents of 2,048 tokens on that shape, blend-fidelity
# (progressive vs one-layer selection) on it, and the comparison
# with Hugging Face on the GPU; and a GPU deployment of SmolLM2's GGUF
# (KDN_SMOLLM2, default ~/.cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf) under
# kdn-bench multiturn --url and serve-load; and the kvbus device planes
# (kvbus/cuda: docs/kvbus.md, "Device planes"): their gpu tests and kdn-bench
# cuda-ipc, 16K tokens of llama3-8b KV between two processes over cuda_ipc and
# nccl against cudaMemcpy. Results go to $OUT (default ./gpu-results; for the
# record, OUT=bench/results/<gpu>-<date>).
#
#   bash scripts/gpu-check.sh BIN_DIR        # BIN_DIR holds kdn_cuda_tests,
#                                            # kdn_kvbus_cuda_tests,
#                                            # kdn_forward_cuda, kdn-mkmodel, kdn-bench,
#                                            # kdn-generate and the four servers
#   STEPS="tests deploy" bash scripts/gpu-check.sh BIN_DIR   # some steps only
#   STEPS=kvbus bash scripts/gpu-check.sh BIN_DIR   # the device planes only
# Steps: tests deploy peer prefill decode serving hf deploy_bench kvbus. Needs a CUDA device; the
# Hugging Face parts need python3 with torch (CUDA) and transformers, the
# deployment test python3 with pytest and httpx. Each step's failure is
# reported and the next one runs.
set -uo pipefail
BIN=${1:?usage: gpu-check.sh BIN_DIR}
OUT=${OUT:-./gpu-results}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
STEPS=${STEPS:-tests deploy peer prefill decode serving hf deploy_bench kvbus}
status=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {
  local name=$1; shift
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?)"; status=1; fi
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
want tests && step cuda_tests "$BIN/kdn_cuda_tests" --gtest_brief=1
want deploy && step deploy_gpu env KDN_BIN_DIR="$BIN" KDN_REPO="$HERE" python3 -m pytest -q \
  -p no:cacheprovider "$HERE/tests/deploy/test_gpu.py"
"$BIN/kdn-mkmodel" --preset llama3-8b --out "$OUT/llama3-8b-config" --config-only > /dev/null
# The peer first, so that kdn-bench puts kdn-vs-transformers ratios into its
# JSON (--peer) beside the ratios to the hardware.
want peer && step hf_peer python3 "$HERE/bench/hf_peer.py" --config "$OUT/llama3-8b-config/config.json" \
  --prefill 2048,8192,32768 --decode 1,32,128 --context 512 --steps 32 --json "$OUT/hf_peer.json"
peer=()
[ -s "$OUT/hf_peer.json" ] && peer=(--peer "$OUT/hf_peer.json")
want prefill && step prefill "$BIN/kdn-bench" prefill --device cuda --preset llama3-8b --tokens 512,2048,8192,32768 \
  --reps 3 "${peer[@]}" --json "$OUT/prefill.json"
want decode && step decode "$BIN/kdn-bench" decode --device cuda --preset llama3-8b --batch 1,32,128 \
  --context 512 --steps 32 "${peer[@]}" --json "$OUT/decode.json"
want decode && step decode_long "$BIN/kdn-bench" decode --device cuda --preset llama3-8b --batch 32 \
  --context 4096 --steps 32 --json "$OUT/decode_long.json"
want serving && step multiturn "$BIN/kdn-bench" multiturn --device cuda --preset llama3-8b \
  --context-tokens 16384 --turns 4 --turn-tokens 64 --max-tokens 16 --conversations 2 --seed 1 \
  --json "$OUT/multiturn.json"
want serving && step rag_blend "$BIN/kdn-bench" rag-blend --device cuda --preset llama3-8b \
  --docs 8 --doc-tokens 2048 --question-tokens 64 --ratios 0,0.15,1 --reps 3 \
  --json "$OUT/rag_blend.json"
# Blend fidelity on that shape (generated weights; the licence texts' bytes
# as tokens): deviation, random and progressive selection against full
# prefill, and rag-blend's TTFT with progressive filtering beside.
want serving && step blend_fidelity "$BIN/kdn-bench" blend-fidelity --device cuda --preset llama3-8b \
  --prompts 50 --docs 8 --doc-tokens 512 --check-layers 1,2,3 --check-layers 1,4,8 \
  --json "$OUT/blend_fidelity.json"
want serving && step rag_blend_progressive "$BIN/kdn-bench" rag-blend --device cuda --preset llama3-8b \
  --docs 8 --doc-tokens 2048 --question-tokens 64 --ratios 0.15 --check-layers 1,2,3 --reps 3 \
  --json "$OUT/rag_blend_progressive.json"
# The kvbus device planes: the extent copy, cuda_ipc and nccl between two
# processes (two ranks on one GPU need NCCL >= 2.30; the two-GPU test skips on
# one), then the request-sized benchmark with its ratio to cudaMemcpy.
want kvbus && step kvbus_cuda_tests "$BIN/kdn_kvbus_cuda_tests" --gtest_brief=1
want kvbus && step cuda_ipc "$BIN/kdn-bench" cuda-ipc --preset llama3-8b --tokens 16384 --reps 5 \
  --json "$OUT/cuda_ipc.json"
want hf && step hf_cuda env KDN_BIN_DIR="$BIN" python3 -m pytest -q -s -p no:cacheprovider "$HERE/tests/cuda/test_hf_cuda.py"
# A whole deployment on the GPU, measured from outside through the router.
SMOL=${KDN_SMOLLM2:-$HOME/.cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf}
deploy_bench() {
  local run="$OUT/deploy-run" rc=0
  rm -rf "$run"
  KDN_BIN_DIR="$BIN" python3 "$HERE/launch/kdn-launch" up --detach --port 0 --run-dir "$run" \
    --model "$SMOL" --store --device cuda --threads 4 --ready-timeout 120 > "$OUT/deploy_up.out" || return 1
  local url; url=$(tail -n 1 "$OUT/deploy_up.out" | awk '{print $NF}')
  # Each beside the other path in one run (docs/serving.md, "Two paths").
  "$BIN/kdn-bench" multiturn --url "$url" --context-tokens 4096 --turns 4 --turn-tokens 64 \
    --max-tokens 16 --conversations 2 --seed 1 --paths always,auto \
    --json "$OUT/deploy_multiturn.json" || rc=1
  "$BIN/kdn-bench" serve-load --url "$url" --clients 32 --requests 1000 --documents 64 \
    --doc-chars 4096 --max-tokens 32 --run-dir "$run" --seed 1 --json "$OUT/deploy_serve_load.json" || rc=1
  "$BIN/kdn-bench" serve-load --url "$url" --clients 16 --requests 400 --documents 32 \
    --doc-chars 4096 --max-tokens 32 --chat-turns 4 --paths always,auto --seed 1 \
    --json "$OUT/deploy_serve_load_chat.json" || rc=1
  KDN_BIN_DIR="$BIN" python3 "$HERE/launch/kdn-launch" down --run-dir "$run" || rc=1
  return $rc
}
if want deploy_bench; then
  if [ -f "$SMOL" ]; then step deploy_bench deploy_bench
  else echo "== deploy_bench: skipped, no $SMOL (scripts/fetch-smollm2.sh)"; fi
fi
exit $status
