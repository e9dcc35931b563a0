"""Greedy-decoding exact match of an exported model on eval.jsonl, by hops.

  python3 evaluate.py --model models/kdn-qa [--eval models/kdn-qa/eval.jsonl]

For each line, the prompt is BOS + documents + "Question: q\\nAnswer:"; the
model decodes greedily (up to --max-tokens bytes or a newline or EOS) and the
text before the first newline, stripped, must equal the answer. This is the
rule kdn-bench quality applies.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import export  # noqa: E402


@torch.no_grad()
def Greedy(model, prompt_ids, max_tokens):
    caches = [[] for _ in model.model.layers]
    logits = model(torch.tensor([prompt_ids]), caches)[0, -1]
    out = []
    for _ in range(max_tokens):
        tok = int(logits.argmax())
        if tok == corpus.EOS or tok == ord("\n"):
            break
        out.append(tok)
        logits = model(torch.tensor([[tok]]), caches)[0, -1]
    return bytes(t for t in out if t < 256).decode("utf-8", errors="replace")


def Evaluate(model, examples, max_tokens=96, verbose=False):
    """Returns {"single_hop": acc, "two_hop": acc, "n": {...}, "answers": [...]}."""
    model.eval()
    hits = {1: 0, 2: 0}
    n = {1: 0, 2: 0}
    answers = []
    for ex in examples:
        prompt = [corpus.BOS] + list(corpus.Prompt(ex["documents"], ex["question"]).encode())
        got = Greedy(model, prompt, max_tokens).strip()
        ok = got == ex["answer"]
        hits[ex["hops"]] += ok
        n[ex["hops"]] += 1
        answers.append(got)
        if verbose and not ok:
            print("MISS hops={} q={!r} want={!r} got={!r}".format(
                ex["hops"], ex["question"], ex["answer"], got))
    return {"single_hop": hits[1] / max(n[1], 1), "two_hop": hits[2] / max(n[2], 1),
            "n": {"single_hop": n[1], "two_hop": n[2]}, "answers": answers}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="exported folder, or a ckpt.pt")
    ap.add_argument("--eval", default=None, help="default MODEL/eval.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json", default=None, help="write the scores here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model.endswith(".pt"):
        model = export.LoadCheckpoint(args.model)
    else:
        model = export.LoadExported(args.model)
    path = args.eval or os.path.join(args.model, "eval.jsonl")
    with open(path) as f:
        examples = [json.loads(line) for line in f if line.strip()]
    if args.limit:
        examples = examples[:args.limit]
    t0 = time.time()
    r = Evaluate(model, examples, args.max_tokens, args.verbose)
    print("single-hop {:.3f} ({} questions), two-hop {:.3f} ({} questions), {:.0f} s".format(
        r["single_hop"], r["n"]["single_hop"], r["two_hop"], r["n"]["two_hop"],
        time.time() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: r[k] for k in ("single_hop", "two_hop", "n")}, f, indent=1)


if __name__ == "__main__":
    main()
