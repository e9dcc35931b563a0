"""The engine against Hugging Face transformers and tokenizers.

Generated models (kdn-mkmodel) are loaded by both sides; transformers runs
them in fp32 on the CPU with eager attention. kdn must agree on the logits of
every position of a 300-token prompt (1e-4 relative to the largest logit) and
on 32 greedy tokens; and kdn's byte-level tokenizer must give the ids that
`tokenizers` gives for the same tokenizer.json.
"""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))
TEXT = (
    "The delivery network keeps the key-value cache of every document it has "
    "seen, so a prompt that repeats one is never computed twice. "
)


def run(*args):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "tiny-mistral", "small"])
def model_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    run(BIN / "kdn-mkmodel", "--preset", request.param, "--seed", "11", "--out", out)
    return out


def prompt_ids(model_dir, n):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (TEXT * (n // len(TEXT) + 1))[: n - 1]
    return [tok.token_to_id("<s>")] + tok.encode(text, add_special_tokens=False).ids


def hf_model(model_dir):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return m.eval()


def test_logits_and_greedy_tokens_match_transformers(model_dir, tmp_path):
    ids = prompt_ids(model_dir, 300)
    assert len(ids) == 300
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward", model_dir, ",".join(map(str, ids)), out, 32)
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]

    model = hf_model(model_dir)
    vocab = model.config.vocab_size
    kdn_logits = np.fromfile(out, dtype=np.float32).reshape(len(ids), vocab)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
        err = np.abs(kdn_logits - ref).max() / np.abs(ref).max()
        print(f"\n{model_dir.name}: max |kdn - hf| / max |hf| over {ref.size} logits = {err:.2e}")
        assert err < 1e-4, f"relative logit error {err:.2e}"

        seq = list(ids)
        for _ in range(32):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert kdn_tokens == seq[len(ids):]


def test_tokenizer_ids_match_hugging_face_tokenizers(model_dir):
    text = "Grüße aus 東京!\n\tTabs, emoji 🙂 and bytes \x01\x7f."
    out = run(BIN / "kdn_forward", "--tokenize", model_dir, text)
    kdn_ids_line, kdn_text = out.split("\n", 1)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    enc = tok.encode(text, add_special_tokens=False)
    assert [int(x) for x in kdn_ids_line.split(",")] == enc.ids
    assert kdn_text == text
    assert tok.decode(enc.ids) == text
