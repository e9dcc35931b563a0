"""Greedy-decoding exact match of an exported model on eval.jsonl, by family.

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
    dev = next(model.parameters()).device
    caches = [[] for _ in model.model.layers]
    logits = model(torch.tensor([prompt_ids], device=dev), caches)[0, -1]
    out = []
    for _ in range(max_tokens):
        tok = int(logits.argmax())
        if tok == corpus.EOS or tok == ord("\n"):
            break
        out.append(tok)
        logits = model(torch.tensor([[tok]], device=dev), caches)[0, -1]
    return bytes(t for t in out if t < 256).decode("utf-8", errors="replace")


def Family(ex):
    """An example's family (eval sets written before families: by hops)."""
    return ex.get("family") or ("single" if ex["hops"] == 1 else "two-hop")


def Evaluate(model, examples, max_tokens=96, verbose=False):
    """Returns {"exact": {family: acc}, "n": {family: count}, "answers": [...]}."""
    model.eval()
    hits, n = {}, {}
    answers = []
    for ex in examples:
        prompt = [corpus.BOS] + list(corpus.Prompt(ex["documents"], ex["question"]).encode())
        got = Greedy(model, prompt, max_tokens).strip()
        ok = got == ex["answer"]
        f = Family(ex)
        hits[f] = hits.get(f, 0) + ok
        n[f] = n.get(f, 0) + 1
        answers.append(got)
        if verbose and not ok:
            print("MISS {} q={!r} want={!r} got={!r}".format(f, ex["question"], ex["answer"], got))
    return {"exact": {f: hits[f] / n[f] for f in n}, "n": n, "answers": answers}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="exported folder, or a ckpt.pt")
    ap.add_argument("--eval", default=None, help="default MODEL/eval.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 on either)")
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
    model = model.to(args.device)
    path = args.eval or os.path.join(args.model, "eval.jsonl")
    with open(path) as f:
        examples = [json.loads(line) for line in f if line.strip()]
    if args.limit:
        examples = examples[:args.limit]
    t0 = time.time()
    r = Evaluate(model, examples, args.max_tokens, args.verbose)
    print("{}: {}, {:.0f} s".format(path, ", ".join(
        "{} {:.3f} ({} questions)".format(f, r["exact"][f], r["n"][f]) for f in r["n"]),
        time.time() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eval": path, "exact": r["exact"], "n": r["n"]}, f, indent=1)


if __name__ == "__main__":
    main()
