"""A real-format model folder served end to end (docs/serving.md, "Model
folders"): transformers writes the model (save_pretrained), the tokenizer is
a real one (the Qwen2 and Llama 3 vocabularies of llama.cpp's test data,
rebuilt as tokenizer.json by tests/parity/gguf_tokenizer.py) with the chat
template those models publish, and kdn-launch serves the folder. A
/v1/chat/completions request must give the text transformers' `generate`
gives on `apply_chat_template`'s prompt, greedy, and count the same prompt
tokens.

The weights are random; so that greedy text is comparable, the output
matrix keeps only the rows of ordinary tokens that decode to printable ASCII
(the others, special tokens included, are zeroed: their logit is 0, and a
positive logit of an ASCII token wins).
"""
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from deploy_util import Deployment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from gguf_tokenizer import read_gguf, write_tokenizer  # noqa: E402
from llama_cpp_ref import ref_dir  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Where is the KV cache of a document kept?"},
    {"role": "assistant", "content": "In the delivery network."},
    {"role": "user", "content": "And what does blending recompute? Über 15% — 東京 🙂"},
]
NEW_TOKENS = 12

# vocabulary, its chat template (None: the one in the gguf's metadata), the
# model class and its config beyond the shared sizes
CASES = {
    "qwen2": ("qwen2", None, Qwen2ForCausalLM, Qwen2Config, dict(rope_theta=1000000.0)),
    "llama3": ("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja", LlamaForCausalLM,
               LlamaConfig, dict(rope_theta=500000.0, rope_scaling={
                   "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})),
}


def make_folder(case, out):
    vocab, template_file, model_cls, config_cls, extra = CASES[case]
    gguf_path = ref_dir() / f"ggml-vocab-{vocab}.gguf"
    write_tokenizer(vocab, gguf_path, out)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    if template_file is None:
        import gguf
        fields = gguf.GGUFReader(str(gguf_path)).fields
        tok_cfg["chat_template"] = fields["tokenizer.chat_template"].contents()
    else:
        tok_cfg["chat_template"] = (ref_dir() / "templates" / template_file).read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    g = read_gguf(gguf_path)
    # The end of an assistant turn in each template, which generation stops at.
    eos = tok.convert_tokens_to_ids("<|im_end|>" if case == "qwen2" else "<|eot_id|>")
    config = config_cls(vocab_size=len(g["tokens"]), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=8192, tie_word_embeddings=False,
                        bos_token_id=tok.bos_token_id, eos_token_id=eos, **extra)
    torch.manual_seed(3)
    model = model_cls(config)
    added = set(tok.get_added_vocab().values())
    with torch.no_grad():
        head = model.lm_head.weight
        for i in range(head.shape[0]):
            text = tok.decode([i])
            if i in added or not (text.strip() and text.isascii() and text.isprintable()):
                head[i].zero_()
    model.save_pretrained(out, safe_serialization=True)
    return tok, eos


@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_on_a_real_format_folder_matches_transformers(case, tmp_path):
    folder = tmp_path / "model"
    tok, eos = make_folder(case, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    # The rendered text encoded without specials added, which is what
    # apply_chat_template(tokenize=True) does (its return type differs
    # between transformers 4 and 5).
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    want = tok.decode(out[0][len(prompt):], skip_special_tokens=True)
    assert want.strip(), "the reference generated no text: the test would show nothing"

    d = Deployment(tmp_path / "run", folder)
    try:
        r = d.chat(MESSAGES, max_tokens=NEW_TOKENS, temperature=0)
    finally:
        d.down()
    assert r["usage"]["prompt_tokens"] == len(prompt)
    assert r["choices"][0]["message"]["content"] == want
