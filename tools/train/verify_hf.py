"""Checks an exported folder against Hugging Face transformers.

  .venv-ref/bin/python tools/train/verify_hf.py --model models/kdn-qa

Loads the folder with transformers' LlamaForCausalLM (fp32) and with model.py,
runs both on the first eval prompt and prints the relative error of the logits
(max |a - b| / max |b|); exits 1 when it is 1e-4 or more. Also checks that
Hugging Face's tokenizer gives the bytes as ids (BOS is prepended by the caller).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import export  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaForCausalLM

    with open(os.path.join(args.model, "eval.jsonl")) as f:
        ex = json.loads(f.readline())
    text = corpus.Prompt(ex["documents"], ex["question"])
    ids = [corpus.BOS] + list(text.encode())
    tok = AutoTokenizer.from_pretrained(args.model)
    hf_ids = tok(text)["input_ids"]
    if hf_ids[:1] != [corpus.BOS]:  # kdn's tokenizer.json adds no BOS itself
        hf_ids = [corpus.BOS] + hf_ids
    if hf_ids != ids:
        print("tokenizer mismatch: HF gives", hf_ids[:12], "...")
        sys.exit(1)
    hf = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    ours = export.LoadExported(args.model).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a = ours(x)
        b = hf(x).logits
    rel = float((a - b).abs().max() / b.abs().max())
    print("prompt of {} tokens: relative error of logits {:.2e}; next byte {!r} (HF {!r})".format(
        len(ids), rel, chr(int(a[0, -1].argmax())), chr(int(b[0, -1].argmax()))))
    sys.exit(0 if rel < 1e-4 else 1)


if __name__ == "__main__":
    main()
