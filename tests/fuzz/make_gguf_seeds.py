"""Writes the seed corpus of the gguf fuzz test (tests/fuzz/corpus/gguf):
micro Llama models, written by the gguf package (tests/parity/gguf_micro.py),
small enough for the harness's -max_len.
    .venv-ref/bin/python tests/fuzz/make_gguf_seeds.py tests/fuzz/corpus/gguf
"""
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from gguf_micro import write_micro_llama  # noqa: E402

CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def gpt2():
    byte_level = ["Ġ", "h", "i", "1", "2", "3", "4", "5", "c", "a", "f", "Ã", "©"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level + ["hi", "Ġhi", "ca"]
    return {"model": "gpt2", "pre": "smollm", "tokens": tokens,
            "token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
            "merges": ["h i", "Ġ hi", "c a"], "chat_template": CHATML}


def spm():
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(0x20, 0x28)] + \
             ["\u2581", "h", "i", "\u2581h", "\u2581hi"]
    return {"model": "llama", "tokens": tokens, "token_type": [2, 3, 3] + [6] * 8 + [1] * 5,
            "scores": [0.0] * 11 + [-1.0, -2.0, -3.0, -0.5, -0.25], "chat_template": CHATML}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    write_micro_llama(out / "seed-gpt2-f32.gguf", d=8, ff=8, tokenizer=gpt2(), seed=19)
    write_micro_llama(out / "seed-spm-f32.gguf", d=8, ff=8, tokenizer=spm(), seed=16)
    write_micro_llama(out / "seed-gpt2-q8_0.gguf", d=32, ff=32, tensor_type=q8, quantize=True,
                      tokenizer=gpt2(), seed=19)
