"""Exports a trained model to a Hugging Face folder kdn's engine loads.

  python3 export.py --ckpt RUN/ckpt.pt --out models/kdn-qa [--dtype bfloat16]

Writes config.json (the fields kdn-mkmodel writes), model.safetensors (HF
Llama tensor names; lm_head left out when tied) and the byte-level tokenizer
files of tokenizer/ (copied from what kdn-mkmodel writes).
"""

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, LlamaForCausalLM  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def Export(model, out, dtype="bfloat16"):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.config.ToHf(dtype), f, indent=2)
        f.write("\n")
    tensors = {k: v.detach().to("cpu", _DTYPES[dtype]).contiguous()
               for k, v in model.HfStateDict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(_HERE, "tokenizer", name), os.path.join(out, name))


def LoadCheckpoint(path):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(Config.FromDict(ck["config"]))
    model.load_state_dict(ck["model"])
    return model


def LoadExported(folder):
    """The exported folder back as a model.py model (fp32)."""
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        model = LlamaForCausalLM(Config.FromDict(json.load(f)))
    sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    model.load_state_dict(sd)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    args = ap.parse_args()
    Export(LoadCheckpoint(args.ckpt), args.out, args.dtype)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
