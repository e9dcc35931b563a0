"""Picks demo examples the model answers, and checks them on kdn's engine.

  python3 demo.py --model models/kdn-qa --out models/kdn-qa/demo.json
  python3 demo.py --model models/kdn-qa --check-kdn build/bin/kdn-generate

The first form draws held-out examples (corpus seed 7: two single-hop, one
two-hop and one coref example, 3 to 5 documents) and keeps the first ones the
PyTorch model answers by greedy decoding. The second runs each demo.json
prompt (and the first eval prompts of each family) through kdn-generate
--temperature 0 and checks the printed continuation.
"""

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import evaluate  # noqa: E402
import export  # noqa: E402


def Pick(model, want=(("single", 2), ("two-hop", 1), ("coref", 1)), tries=200):
    rng = random.Random(7)
    out = []
    for family, count in want:
        got = 0
        for _ in range(tries):
            ex = corpus.MakeExample(rng, held_out=True, family=family, n_docs=rng.randint(3, 5))
            prompt = [corpus.BOS] + list(corpus.Prompt(ex["documents"], ex["question"]).encode())
            if evaluate.Greedy(model, prompt, 96).strip() == ex["answer"]:
                out.append({"documents": ex["documents"], "question": ex["question"],
                            "answer": ex["answer"]})
                got += 1
                if got == count:
                    break
    return out


def CheckKdn(binary, model_dir, examples):
    ok = 0
    for ex in examples:
        prompt = corpus.Prompt(ex["documents"], ex["question"])
        r = subprocess.run([binary, "--model", model_dir, "--prompt", prompt,
                            "--max-tokens", "96", "--temperature", "0"],
                           capture_output=True, text=True, check=True)
        got = r.stdout.split("\n")[0].strip()
        ok += got == ex["answer"]
        print("kdn-generate: {!r} -> {!r} (want {!r}) {}".format(
            ex["question"], got, ex["answer"], "ok" if got == ex["answer"] else "MISS"))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--check-kdn", default=None, help="path of kdn-generate")
    ap.add_argument("--eval-count", type=int, default=6)
    args = ap.parse_args()
    if args.out:
        import torch
        torch.set_num_threads(2)
        model = export.LoadExported(args.model).eval()
        demos = Pick(model)
        with open(args.out, "w") as f:
            json.dump(demos, f, indent=1)
            f.write("\n")
        print("wrote {} demo examples to {}".format(len(demos), args.out))
    if args.check_kdn:
        with open(os.path.join(args.model, "demo.json")) as f:
            examples = json.load(f)
        with open(os.path.join(args.model, "eval.jsonl")) as f:
            ev = [json.loads(line) for line in f]
        for family in corpus.FAMILIES:
            examples += [e for e in ev if evaluate.Family(e) == family][:args.eval_count // 3]
        ok = CheckKdn(args.check_kdn, args.model, examples)
        print("kdn-generate answered {}/{}".format(ok, len(examples)))


if __name__ == "__main__":
    main()
