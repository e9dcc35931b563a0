#!/usr/bin/env python3
"""Engines other than kdn on kdn's KDN (docs/clients.md): time to first
token of one long prompt with full prefill against with the prompt's KV
fetched from the KDN, in one run.

  python3 bench/foreign_engines.py --json /tmp/foreign.json
  .venv-vllm/bin/python bench/foreign_engines.py --engines vllm --json /tmp/vllm.json

It starts what it needs: a kdn-store (kdn's binaries from build/bin or
KDN_BIN_DIR) on loopback, and the engine in this process.
- transformers (SmolLM2-135M-Instruct, fp32, sdpa where torch has it): full is one forward of
  the prompt and the argmax of its last logits; hit is kdn.hf.fetch_cache
  (lookup, fetch, DynamicCache) and a forward of the uncached last token.
  The KV was stored by kdn.hf.store_cache from a full prefill.
- vllm (scripts/vllm-env.sh's environment; kdn.vllm as its KV connector,
  vLLM's own prefix caching off so that hits come from the KDN): full is a
  1-token generate of the prompt in an engine whose KDN lacks it; hit the
  same prompt in a second engine process after the first stored it.
Each time is the median of --repeats runs after one warm-up. JSON: `rows`,
each with engine, prompt_tokens, cached_tokens, ttft_full_ms, ttft_hit_ms
and speedup (full over hit).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN_DIR = Path(os.environ.get("KDN_BIN_DIR") or REPO / "build" / "bin").resolve()
os.environ.setdefault("KDN_LIB_DIR", str(BIN_DIR.parent / "lib"))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "parity"))

CHUNK = 256


def log(msg):
    print("[foreign-engines %s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr,
          flush=True)


def start_store(mib):
    p = subprocess.Popen([str(BIN_DIR / "kdn-store"), "--listen", "tcp://127.0.0.1:0",
                          "--host-mib", str(mib), "--log-level", "warn"],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("tcp://"):
        p.kill()
        raise SystemExit("kdn-store did not start (KDN_BIN_DIR=%s)" % BIN_DIR)
    return p, "kdn-store://" + line[len("tcp://"):]


def prompt_ids(tokens, vocab, seed=7):
    # Token ids of ordinary text would do as well; the engines' times do not
    # depend on the ids. A fixed pseudo-random run past the special tokens.
    x, ids = seed, []
    for _ in range(tokens):
        x = (x * 1103515245 + 12345) % (1 << 31)
        ids.append(200 + x % (vocab - 200))
    return ids


def median_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_transformers(args, uri):
    import gguf
    import torch
    from transformers import LlamaForCausalLM

    import kdn
    import kdn.hf
    from test_gguf import hf_folder

    folder = Path(args.work) / "smollm2-hf"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        hf_folder(gguf.GGUFReader(str(args.model)), folder)
    # sdpa where this torch has it (2.1.1 on), else eager.
    try:
        attn = "sdpa"
        model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    except ImportError:
        attn = "eager"
        model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    torch.set_num_threads(args.threads)
    client = kdn.Client(uri, kdn.Model(args.model, kv_dtype="f32"), chunk_tokens=CHUNK)
    ids = prompt_ids(args.prompt_tokens, model.config.vocab_size)
    x = torch.tensor([ids])

    def first_token(input_ids, cache=None):
        # The base model, then the head on the last position only: a first
        # token needs no other logits (as kdn's prefill computes it).
        with torch.no_grad():
            out = model.model(input_ids, past_key_values=cache, use_cache=True)
            return int(model.lm_head(out.last_hidden_state[:, -1]).argmax())

    log("transformers: full prefill of %d tokens" % len(ids))
    with torch.no_grad():
        first = model(x, use_cache=True)
    r = kdn.hf.store_cache(model, ids, first.past_key_values, client)
    log("transformers: stored %s" % r)
    ttft_full = median_ms(lambda: first_token(x), args.repeats)
    cached = [0]

    def hit():
        cache, n = kdn.hf.fetch_cache(model, ids, client)
        cached[0] = n
        return first_token(x[:, n:], cache)

    ttft_hit = median_ms(hit, args.repeats)
    # The token is the same either way (the bench's own sanity check).
    assert hit() == int(first.logits[0, -1].argmax())
    client.close()
    return dict(engine="transformers %s (torch %s, %s, fp32)" % (
        __import__("transformers").__version__, torch.__version__, attn),
                prompt_tokens=len(ids), cached_tokens=cached[0], ttft_full_ms=round(ttft_full, 1),
                ttft_hit_ms=round(ttft_hit, 1), speedup=round(ttft_full / ttft_hit, 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get(
        "KDN_SMOLLM2", str(Path.home() / ".cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf")),
        help="SmolLM2's GGUF (scripts/fetch-smollm2.sh)")
    ap.add_argument("--engines", default="transformers",
                    help="comma-separated: transformers, vllm (default transformers)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", default="/tmp/kdn-foreign-engines",
                    help="folder for the HF model folder and vLLM's logs")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not Path(args.model).is_file():
        raise SystemExit("%s: SmolLM2 is missing (scripts/fetch-smollm2.sh)" % args.model)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    store, uri = start_store(4096)
    rows = []
    try:
        for engine in args.engines.split(","):
            if engine == "transformers":
                rows.append(bench_transformers(args, uri))
            elif engine == "vllm":
                sys.path.insert(0, str(REPO / "bench"))
                from vllm_bench import bench_vllm  # noqa: E402 (bench/vllm_bench.py)
                rows.append(bench_vllm(args, uri, prompt_ids))
            else:
                raise SystemExit("unknown engine %r (transformers, vllm)" % engine)
            log(json.dumps(rows[-1]))
    finally:
        store.terminate()
        store.wait(timeout=30)
    result = dict(bench="foreign_engines", model=Path(args.model).name, machine=platform.node(),
                  cpus=os.cpu_count(), threads=args.threads, chunk_tokens=CHUNK, rows=rows)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
