"""The vLLM row of bench/foreign_engines.py: vLLM's CPU build with kdn.vllm
as its KV connector (vLLM's own prefix caching off, so that every hit is the
KDN's), in a process of its own (vLLM's CPU engine spawns its workers).

full: a 1-token generate of a prompt the KDN lacks (a new prompt each run,
its KV kept out of the KDN: kdn_store false); hit: a 1-token generate of a
prompt vLLM stored first, its KV fetched from the KDN each run. Medians of
--repeats runs after one warm-up, as for transformers.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_vllm(args, uri, prompt_ids):
    folder = Path(args.work) / "smollm2-hf"
    if not (folder / "config.json").exists():
        raise SystemExit("bench_vllm: %s is missing (run the transformers row first)" % folder)
    out = Path(args.work) / "vllm-row.json"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "bench"),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, str(folder), args.model, uri, str(args.prompt_tokens),
           str(args.repeats), str(out)]
    with open(Path(args.work) / "vllm.log", "w") as logf:
        r = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=1800)
    if r.returncode != 0:
        raise SystemExit("the vLLM row failed (exit %d): see %s" % (r.returncode,
                                                                  Path(args.work) / "vllm.log"))
    return json.loads(out.read_text())


def run(folder, model, uri, prompt_tokens, repeats, out):
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from foreign_engines import prompt_ids

    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=prompt_tokens + 64, seed=0, gpu_memory_utilization=0.5,
              enable_prefix_caching=False, kv_transfer_config={
                  "kv_connector": "KdnConnector", "kv_connector_module_path": "kdn.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"kdn_uri": uri, "kdn_model": model}})
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def first_token(ids, store):
        sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                            extra_args={"kv_transfer_params": {"kdn_store": store}})
        t0 = time.perf_counter()
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        return (time.perf_counter() - t0) * 1e3, r.num_cached_tokens or 0

    full = [first_token(prompt_ids(prompt_tokens, vocab, seed=100 + i), False)[0]
            for i in range(repeats + 1)][1:]
    hit_ids = prompt_ids(prompt_tokens, vocab, seed=99)
    first_token(hit_ids, True)  # stores it
    hits = [first_token(hit_ids, False) for _ in range(repeats + 1)][1:]
    f, h = statistics.median(full), statistics.median(t for t, _ in hits)
    row = dict(engine="vllm %s (CPU, fp32, block %d)" % (vllm.__version__,
                                                         llm.llm_engine.vllm_config.cache_config.block_size),
               prompt_tokens=prompt_tokens, cached_tokens=hits[-1][1], ttft_full_ms=round(f, 1),
               ttft_hit_ms=round(h, 1), speedup=round(f / h, 2))
    Path(out).write_text(json.dumps(row))


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
