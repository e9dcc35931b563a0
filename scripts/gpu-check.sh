#!/usr/bin/env bash
# What a GPU machine runs for kdn, in two profiles:
#
#   quick  the GPU tests (kdn_cuda_tests), a GPU deployment of SmolLM2's GGUF
#          whose greedy chat turns must equal kdn-generate's on the GPU, and
#          every step docs/engine.md lists under "Owed on a GPU" (it reads
#          that table and nothing else). 163 s on an H100 on 2026-11-27.
#   full   every step below, owed or not (the benchmarks on the llama3-8b
#          shape and Hugging Face's peer besides: several times longer).
#
#   scripts/gpu-check.sh [--profile quick|full] [BIN_DIR]
#   STEPS="kvbus multiturn" scripts/gpu-check.sh [BIN_DIR]    # these steps only
#
# BIN_DIR holds the programs (kdn_cuda_tests, kdn_kvbus_cuda_tests, kdn-bench,
# kdn-generate, kdn-mkmodel, the servers); by default the bin/ of the
# unpacked release this script sits in (scripts/package.sh), else build/bin.
# Steps: tests device_thread deploy peer prefill decode multiturn rag_blend
# blend_fidelity hf kvbus smollm2 deploy_paths turn_phases deploy_bench
# planes (serving = multiturn rag_blend blend_fidelity). deploy_paths and
# deploy_bench run on the SmolLM2 deployment of step smollm2, turn_phases on
# one of its own at log level debug, planes on two of its own (the cuda_ipc
# plane against the host path: scripts/planes-check.py) (KDN_SMOLLM2, default
# ~/.cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf; these steps are skipped,
# saying so, without the file). deploy and hf need the source tree's
# tests/ and python3 with pytest, httpx, torch and transformers; the others
# need python3 alone.
#
# It prints the GPU, driver, CUDA and NCCL versions first and a table of every
# figure with its aim (pass/short) last (scripts/gpu-figures.py). Results go
# to $OUT (default ./gpu-results; for the record, bench/results/<gpu>-<date>).
# Each step's failure is reported and the next one runs; the exit code is 1
# when a step failed. Without a GPU it says so and exits 0, running nothing.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
profile=full
explicit_profile=0
BIN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:-}; explicit_profile=1; shift 2 || break ;;
    --profile=*) profile=${1#--profile=}; explicit_profile=1; shift ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu-check: unknown flag $1 (--profile quick|full, --help)" >&2; exit 2 ;;
    *) [ -z "$BIN" ] || { echo "gpu-check: one BIN_DIR, not '$BIN' and '$1'" >&2; exit 2; }
       BIN=$1; shift ;;
  esac
done
case "$profile" in quick|full) ;; *) echo "gpu-check: --profile takes quick or full, not '$profile'" >&2; exit 2 ;; esac
if [ -z "$BIN" ]; then
  if [ -x "$HERE/bin/kdn-bench" ]; then BIN=$HERE/bin; else BIN=$HERE/build/bin; fi
fi
[ -d "$BIN" ] || { echo "gpu-check: no folder $BIN" >&2; exit 2; }
BIN=$(cd "$BIN" && pwd)
OUT=${OUT:-./gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# The versions this machine has, before anything runs.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "gpu-check: no GPU on this machine (nvidia-smi lists none); nothing run"
  exit 0
fi
# CUDA's own libraries (cudart, cuBLAS, NCCL) are the machine's: where the
# loader does not find them, look in the toolkit's folders, then in Python's
# nvidia packages, before giving up with their names.
missing() { ldd "$BIN/kdn-bench" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' '; }
if [ -x "$BIN/kdn-bench" ] && [ -n "$(missing)" ]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c "import nvidia, os; p = nvidia.__path__[0]; print(' '.join(os.path.join(p, x, 'lib') for x in sorted(os.listdir(p))))" 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
    [ -z "$(missing)" ] && break
  done
  [ -z "$(missing)" ] || { echo "gpu-check: the programs need $(missing)which this machine lacks" >&2; exit 1; }
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9.]*\).*/\1/p' | head -n 1)
  toolkit=$( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) |
             sed -n 's/.*release \([0-9.]*\).*/\1/p')
  echo "CUDA: driver supports ${cuda:-?}, toolkit ${toolkit:-none found}"
  nccl=""
  for prog in "$BIN/kdn_kvbus_cuda_tests" "$BIN/kdn-bench"; do
    [ -x "$prog" ] || continue
    lib=$(ldd "$prog" 2>/dev/null | awk '/libnccl/ {print $3; exit}')
    [ -n "$lib" ] && nccl=$(readlink -f "$lib") && break
  done
  echo "NCCL the programs load: ${nccl:-none (not linked, or not found: see ldd)}"
  torch_nccl=$(python3 -c "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))" 2>/dev/null)
  [ -n "$torch_nccl" ] && echo "NCCL in PyTorch: $torch_nccl"
  echo "profile $profile, programs in $BIN, results in $OUT"
} | tee "$OUT/gpu.txt"

# The steps: named by STEPS, else by the profile (quick: the tests, SmolLM2's
# deployment and the owed table's steps).
owed_steps() {
  local doc=$HERE/docs/engine.md
  [ -f "$doc" ] || { echo "gpu-check: no $doc to read the owed runs from" >&2; return 1; }
  awk '/^## Owed on a GPU/ {on=1; next} on && /^## / {on=0} on && /^\| `/ {print}' "$doc" |
    sed -n 's/^| `\([a-z_]*\)`.*/\1/p'
}
if [ -n "${STEPS:-}" ]; then
  [ $explicit_profile = 1 ] && echo "gpu-check: STEPS given; --profile $profile ignored"
  steps=" $STEPS "
elif [ "$profile" = quick ]; then
  owed=$(owed_steps) || exit 2
  known=" tests device_thread deploy peer prefill decode multiturn rag_blend blend_fidelity hf kvbus smollm2 deploy_paths turn_phases deploy_bench planes serving "
  for o in $owed; do
    [[ "$known" == *" $o "* ]] || echo "gpu-check: docs/engine.md owes '$o', which is no step of this script" >&2
  done
  steps=" tests smollm2 $(echo $owed) "
  echo "owed (docs/engine.md): ${owed:-nothing}" | tr '\n' ' '; echo
else
  steps=" tests deploy peer prefill decode serving hf kvbus smollm2 deploy_paths turn_phases deploy_bench planes "
fi
steps=${steps/ serving / multiturn rag_blend blend_fidelity }
want() { [[ "$steps" == *" $1 "* ]]; }
# The quick profile's shorter forms of the long steps.
quick() { [ "$profile" = quick ]; }

status=0
failed=()
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "   ok ($((SECONDS - t0)) s)"
  else echo "   FAILED (rc $?, $((SECONDS - t0)) s)"; status=1; failed+=("$name"); fi
  tail -n 25 "$OUT/$name.log"
}
export NCCL_MULTI_RANK_GPU_ENABLE=1  # two ranks on one GPU, where NCCL >= 2.30

if want tests; then
  step cuda_tests "$BIN/kdn_cuda_tests" --gtest_brief=1
elif want device_thread; then
  step cuda_tests "$BIN/kdn_cuda_tests" --gtest_brief=1 --gtest_filter='CudaDeviceThread.*'
fi
want deploy && step deploy_gpu env KDN_BIN_DIR="$BIN" KDN_REPO="$HERE" python3 -m pytest -q \
  -p no:cacheprovider "$HERE/tests/deploy/test_gpu.py"
# The kvbus device planes: the extent copy, cuda_ipc and nccl between two
# processes (two ranks on one GPU need NCCL >= 2.30; the two-GPU test skips on
# one), then the request-sized benchmark with its ratio to cudaMemcpy.
if want kvbus; then
  step kvbus_cuda_tests "$BIN/kdn_kvbus_cuda_tests" --gtest_brief=1
  step cuda_ipc "$BIN/kdn-bench" cuda-ipc --preset llama3-8b --tokens 16384 --reps 5 \
    --json "$OUT/cuda_ipc.json"
fi
if want peer || want prefill || want decode; then
  "$BIN/kdn-mkmodel" --preset llama3-8b --out "$OUT/llama3-8b-config" --config-only > /dev/null
fi
# The peer first, so that kdn-bench puts kdn-vs-transformers ratios into its
# JSON (--peer) beside the ratios to the hardware.
want peer && step hf_peer python3 "$HERE/bench/hf_peer.py" --config "$OUT/llama3-8b-config/config.json" \
  --prefill 2048,8192,32768 --decode 1,32,128 --context 512 --steps 32 --json "$OUT/hf_peer.json"
peer=()
[ -s "$OUT/hf_peer.json" ] && peer=(--peer "$OUT/hf_peer.json")
want prefill && step prefill "$BIN/kdn-bench" prefill --device cuda --preset llama3-8b \
  --tokens 512,2048,8192,32768 --reps 3 "${peer[@]}" --json "$OUT/prefill.json"
want decode && step decode "$BIN/kdn-bench" decode --device cuda --preset llama3-8b --batch 1,32,128 \
  --context 512 --steps 32 "${peer[@]}" --json "$OUT/decode.json"
want decode && step decode_long "$BIN/kdn-bench" decode --device cuda --preset llama3-8b --batch 32 \
  --context 4096 --steps 32 --json "$OUT/decode_long.json"
# Multiturn at 16K: the prefill worker's logic with resident KV and with
# residency off, and the decode worker's local prefill, in one run.
want multiturn && step multiturn "$BIN/kdn-bench" multiturn --device cuda --preset llama3-8b \
  --context-tokens 16384 --turns 4 --turn-tokens 64 --max-tokens 16 --conversations 2 --seed 1 \
  --json "$OUT/multiturn.json"
want rag_blend && step rag_blend "$BIN/kdn-bench" rag-blend --device cuda --preset llama3-8b \
  --docs 8 --doc-tokens 2048 --question-tokens 64 --ratios 0,0.15,1 --reps 3 \
  --json "$OUT/rag_blend.json"
# Blend fidelity on that shape (generated weights; the licence texts' bytes
# as tokens): deviation, random and progressive selection against full
# prefill, and rag-blend's TTFT with progressive filtering beside.
if want blend_fidelity; then
  step blend_fidelity "$BIN/kdn-bench" blend-fidelity --device cuda --preset llama3-8b \
    --prompts "$(quick && echo 16 || echo 50)" --docs 8 --doc-tokens 512 \
    --check-layers 1,2,3 --check-layers 1,4,8 --json "$OUT/blend_fidelity.json"
  step rag_blend_progressive "$BIN/kdn-bench" rag-blend --device cuda --preset llama3-8b \
    --docs 8 --doc-tokens 2048 --question-tokens 64 --ratios 0.15 --check-layers 1,2,3 --reps 3 \
    --json "$OUT/rag_blend_progressive.json"
fi
want hf && step hf_cuda env KDN_BIN_DIR="$BIN" python3 -m pytest -q -s -p no:cacheprovider \
  "$HERE/tests/cuda/test_hf_cuda.py"

# A GPU deployment of SmolLM2 (one prefill and one decode worker on the GPU,
# kdn-store), measured from outside through the router.
SMOL=${KDN_SMOLLM2:-$HOME/.cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN="$OUT/deploy-run"
# Each turn of a two-turn chat, greedy, as kdn-generate computes it alone on
# the GPU (before the deployment takes the GPU's memory): smollm2_want.json.
smollm2_generate() {
  python3 - "$BIN/kdn-generate" "$SMOL" "$OUT/smollm2_want.json" <<'PY'
import json, subprocess, sys
gen, model, out = sys.argv[1:4]
system = "Answer in one short sentence."
messages = [{"role": "system", "content": system}]
turns = []
def render(ms):
    return ("<|im_start|>system\n" + ms[0]["content"] + "<|im_end|>\n"
            + "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in ms[1:])
            + "<|im_start|>assistant\n")
for q in ["What is the capital of France?", "And of Germany?"]:
    messages.append({"role": "user", "content": q})
    r = subprocess.run([gen, "--model", model, "--prompt", render(messages), "--max-tokens", "24",
                        "--device", "cuda", "--no-bos"], capture_output=True, timeout=300)
    if r.returncode != 0:
        sys.exit("kdn-generate failed: " + r.stderr.decode(errors="replace")[-2000:])
    answer = r.stdout.decode()[:-1]
    turns.append({"messages": list(messages), "want": answer})
    messages.append({"role": "assistant", "content": answer})
    print("kdn-generate turn %d: %r" % (len(turns), answer))
json.dump(turns, open(out, "w"), indent=1)
PY
}
# The deployment's answers to the same turns, twice each (the repeat must
# reuse KV): smollm2_deploy.json, which gpu-figures.py reads.
smollm2_compare() {
  python3 - "$1" "$OUT/smollm2_want.json" "$OUT/smollm2_deploy.json" <<'PY'
import json, sys, urllib.request
url, want_file, out = sys.argv[1:4]
turns = json.load(open(want_file))
def chat(messages):
    body = json.dumps({"messages": messages, "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)
equal, cached = 0, None
for i, t in enumerate(turns, 1):
    got = chat(t["messages"])["choices"][0]["message"]["content"]
    again = chat(t["messages"])
    same = got == t["want"] and again["choices"][0]["message"]["content"] == got
    cached = ((again.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    equal += same and cached > 0
    print("turn %d: %s (deployment %r, kdn-generate %r; the repeat found %d tokens cached)"
          % (i, "equal" if same else "DIFFERENT", got, t["want"], cached))
ok = equal == len(turns)
json.dump({"turns": len(turns), "equal": equal, "repeat_cached_tokens": cached, "ok": ok},
          open(out, "w"))
sys.exit(0 if ok else 1)
PY
}
deploy_paths() {
  local url=$1
  "$BIN/kdn-bench" multiturn --url "$url" --context-tokens 4096 --turns 4 --turn-tokens 64 \
    --max-tokens 16 --conversations 2 --seed 1 --paths always,auto \
    --json "$OUT/deploy_multiturn.json" || return 1
  "$BIN/kdn-bench" serve-load --url "$url" --clients 16 --requests "$(quick && echo 120 || echo 400)" \
    --documents 32 --doc-chars 4096 --max-tokens 32 --chat-turns 4 --paths always,auto --seed 1 \
    --json "$OUT/deploy_serve_load_chat.json"
}
# Where later turns' time goes: a deployment of its own at log level debug
# (the router's lookups and the workers' answers to them are logged too),
# four-turn conversations on each path, then each request's milestones from
# the processes' logs (scripts/request-phases.py).
turn_phases() {
  local run="$OUT/phases-run" url rc=0
  up_smollm2 "$run" "$OUT/phases_up.out" --log-level debug || return 1
  url=$(url_of "$OUT/phases_up.out")
  "$BIN/kdn-bench" multiturn --url "$url" --context-tokens 4096 --turns 4 --turn-tokens 64 \
    --max-tokens 16 --conversations 2 --seed 7 --paths always,auto > "$OUT/turn_phases_multiturn.log" ||
    rc=1
  down_smollm2 "$run" "$OUT/phases_logs.tgz" || rc=1
  python3 "$HERE/scripts/request-phases.py" "$run" --json "$OUT/turn_phases.json" \
    > "$OUT/turn_phases.txt" || rc=1
  sed -n '/medians/,$p' "$OUT/turn_phases.txt"
  return $rc
}
up_smollm2() {
  local run=$1 log=$2
  shift 2
  rm -rf "$run"
  KDN_BIN_DIR="$BIN" python3 "$HERE/launch/kdn-launch" up --detach --port 0 --run-dir "$run" \
    --model "$SMOL" --store --device cuda --threads 4 --ready-timeout 120 "$@" > "$log" 2>&1
}
# The router's URL, the last word of kdn-launch up's output in file $1.
url_of() { tail -n 1 "$1" | awk '{print $NF}'; }
# Stops the deployment of run folder $1 and keeps its logs in the tarball $2.
down_smollm2() {
  local rc=0
  KDN_BIN_DIR="$BIN" python3 "$HERE/launch/kdn-launch" down --run-dir "$1" > /dev/null || rc=1
  tar czf "$2" -C "$1" logs 2>/dev/null
  return $rc
}
deploy_bench() {
  "$BIN/kdn-bench" serve-load --url "$1" --clients 32 --requests 1000 --documents 64 \
    --doc-chars 4096 --max-tokens 32 --run-dir "$RUN" --seed 1 --json "$OUT/deploy_serve_load.json"
}
if want smollm2 || want deploy_paths || want turn_phases || want deploy_bench || want planes; then
  if [ ! -f "$SMOL" ]; then
    echo "== smollm2: skipped, no $SMOL (scripts/fetch-smollm2.sh, or KDN_SMOLLM2)"
  else
    step smollm2_generate smollm2_generate
    if want smollm2 || want deploy_paths || want deploy_bench; then
      echo "== smollm2: kdn-launch up --store --device cuda --model $SMOL"
      if up_smollm2 "$RUN" "$OUT/deploy_up.out"; then
        url=$(url_of "$OUT/deploy_up.out")
        [ -s "$OUT/smollm2_want.json" ] && step smollm2 smollm2_compare "$url"
        want deploy_paths && step deploy_paths deploy_paths "$url"
        want deploy_bench && step deploy_bench deploy_bench "$url"
        down_smollm2 "$RUN" "$OUT/deploy_logs.tgz" || { echo "   kdn-launch down FAILED"; status=1; }
      else
        echo "   FAILED: the deployment did not come up"; tail -n 30 "$OUT/deploy_up.out"
        status=1; failed+=(smollm2)
      fi
    fi
    want turn_phases && step turn_phases turn_phases
    # The cuda_ipc plane against the host path, each on a deployment of its own.
    want planes && [ -s "$OUT/smollm2_want.json" ] &&
      step planes python3 "$HERE/scripts/planes-check.py" "$BIN" "$HERE" "$SMOL" "$OUT"
  fi
fi

echo
echo "== figures ($OUT)"
python3 "$HERE/scripts/gpu-figures.py" "$OUT" | tee "$OUT/figures.txt"
[ ${#failed[@]} -gt 0 ] && echo "failed steps: ${failed[*]}"
exit $status
