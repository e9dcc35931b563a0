"""Writes the seed corpus of the gguf fuzz test (tests/fuzz/corpus/gguf):
micro Llama models, written by the gguf package, small enough for the
harness's -max_len.
    .venv-ref/bin/python tests/fuzz/make_gguf_seeds.py tests/fuzz/corpus/gguf
"""
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import quants

CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write(path, d, tensor_type, tokenizer):
    w = gguf.GGUFWriter(str(path), "llama")
    ff, heads, kv = d, 2, 1
    tokens, types = tokenizer["tokens"], tokenizer["types"]
    w.add_uint32("llama.embedding_length", d)
    w.add_uint32("llama.feed_forward_length", ff)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", kv)
    w.add_uint32("llama.context_length", 32)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("llama.rope.dimension_count", d // heads)
    w.add_string("tokenizer.ggml.model", tokenizer["model"])
    if "pre" in tokenizer:
        w.add_string("tokenizer.ggml.pre", tokenizer["pre"])
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    if "merges" in tokenizer:
        w.add_array("tokenizer.ggml.merges", tokenizer["merges"])
    if "scores" in tokenizer:
        w.add_array("tokenizer.ggml.scores", tokenizer["scores"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", tokenizer["model"] == "llama")
    w.add_string("tokenizer.chat_template", CHATML)
    rng = np.random.default_rng(len(tokens))
    vocab, hd = len(tokens), d // heads
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,),
              "blk.0.attn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d),
              "blk.0.attn_k.weight": (kv * hd, d), "blk.0.attn_v.weight": (kv * hd, d),
              "blk.0.attn_output.weight": (d, d), "blk.0.ffn_norm.weight": (d,),
              "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d),
              "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, quants.quantize(x, tensor_type), raw_dtype=tensor_type)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gpt2():
    byte_level = ["Ġ", "h", "i", "1", "2", "3", "4", "5", "c", "a", "f", "Ã", "©"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level + ["hi", "Ġhi", "ca"]
    return {"model": "gpt2", "pre": "smollm", "tokens": tokens,
            "types": [3, 3, 3] + [1] * (len(tokens) - 3),
            "merges": ["h i", "Ġ hi", "c a"]}


def spm():
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(0x20, 0x28)] + \
             ["\u2581", "h", "i", "\u2581h", "\u2581hi"]
    return {"model": "llama", "tokens": tokens, "types": [2, 3, 3] + [6] * 8 + [1] * 5,
            "scores": [0.0] * 11 + [-1.0, -2.0, -3.0, -0.5, -0.25]}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write(out / "seed-gpt2-f32.gguf", 8, gguf.GGMLQuantizationType.F32, gpt2())
    write(out / "seed-spm-f32.gguf", 8, gguf.GGMLQuantizationType.F32, spm())
    write(out / "seed-gpt2-q8_0.gguf", 32, gguf.GGMLQuantizationType.Q8_0, gpt2())
