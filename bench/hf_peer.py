#!/usr/bin/env python3
"""The peer of `kdn-bench prefill/decode --device cuda`: the same model shape
through Hugging Face transformers (sdpa attention, bf16) on the same GPU.

  build/bin/kdn-mkmodel --preset llama3-8b --out /tmp/l8 --config-only
  python3 bench/hf_peer.py --config /tmp/l8/config.json --prefill 2048,8192,32768 \
      --decode 1,32,128 --context 512 --steps 32 --json /tmp/hf.json

Weights are random (the shape is what is timed). Prefill times a forward pass
of one prompt, logits of its last token only, as kdn's prefill returns them.
Decode prefills `context` tokens per sequence, then times `steps` steps of
one token per sequence with the KV cache. Needs torch with CUDA and
transformers (not a kdn dependency).
"""

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def ints(text):
    return [int(x) for x in text.split(",") if x]


def timed(fn, reps):
    fn()  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json (kdn-mkmodel --config-only)")
    ap.add_argument("--prefill", type=ints, default=[2048, 8192, 32768])
    ap.add_argument("--decode", type=ints, default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = AutoConfig.from_pretrained(args.config)
    cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                 torch_dtype=torch.bfloat16)
    model.eval()
    gpu = torch.cuda.get_device_name()
    out = {"peer": "transformers %s, sdpa, bf16" % __import__("transformers").__version__,
           "device": gpu, "prefill": [], "decode": []}
    print("Hugging Face peer on %s: %s" % (gpu, out["peer"]))
    with torch.inference_mode():
        for n in args.prefill:
            ids = (torch.arange(n, device="cuda") * 131 + 7) % min(cfg.vocab_size, 32000)
            ids = ids[None]

            def run():
                h = model.model(input_ids=ids, use_cache=False).last_hidden_state
                return model.lm_head(h[:, -1:])

            s = timed(run, args.reps)
            out["prefill"].append({"tokens": n, "seconds": s, "tokens_per_s": n / s})
            print("prefill %6d tokens: %.4f s, %.0f tokens/s" % (n, s, n / s))
            torch.cuda.empty_cache()
        for b in args.decode:
            ids = (torch.arange(args.context, device="cuda") * 17) % 256
            ids = ids[None].repeat(b, 1)
            first = model(input_ids=ids, use_cache=True)
            past = first.past_key_values
            nxt = torch.full((b, 1), 65, device="cuda")

            def step_all():
                nonlocal past
                for _ in range(args.steps):
                    r = model(input_ids=nxt, past_key_values=past, use_cache=True)
                    past = r.past_key_values

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_all()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            out["decode"].append({"batch": b, "tokens_per_s": b * args.steps / s,
                                  "ms_per_step": 1e3 * s / args.steps})
            print("decode batch %4d: %.1f tokens/s, %.2f ms/step"
                  % (b, b * args.steps / s, 1e3 * s / args.steps))
            del past, first
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
