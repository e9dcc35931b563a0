"""Micro Llama models as GGUF files, written by the gguf package: for
test_gguf.py's malformed-file tests and the gguf fuzz test's seeds
(tests/fuzz/make_gguf_seeds.py); and where SmolLM2 is (smollm2_path)."""
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import quants


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh), or a failed test."""
    p = Path(os.environ.get("KDN_SMOLLM2",
                            Path.home() / ".cache" / "kdn" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not p.is_file():
        pytest.fail(f"{p}: SmolLM2 is missing; run scripts/install-deps.sh --ref "
                    "(or scripts/fetch-smollm2.sh)")
    return p


def write_micro_llama(path, d=64, ff=96, vocab=8, heads=2, kv_heads=1, block_count=1,
                      arch="llama", tensor_type=gguf.GGMLQuantizationType.F32,
                      quantize=False, keys=None, tokenizer=None, seed=1):
    """A one-layer model. Matrices of a type other than F32 hold random
    blocks, or with `quantize` the quantized random values. `keys` maps a key
    to a function(writer, key) that adds it; `tokenizer` is a dict of the
    tokenizer.ggml.* keys (model, pre, tokens, types, merges, scores,
    chat_template)."""
    w = gguf.GGUFWriter(str(path), arch)
    hd = d // heads
    w.add_uint32(f"{arch}.embedding_length", d)
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.block_count", block_count)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_uint32(f"{arch}.context_length", 64)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if tokenizer is None:
        w.add_uint32(f"{arch}.vocab_size", vocab)
    else:
        vocab = len(tokenizer["tokens"])
        w.add_string("tokenizer.ggml.model", tokenizer["model"])
        if "pre" in tokenizer:
            w.add_string("tokenizer.ggml.pre", tokenizer["pre"])
        for key in ("tokens", "token_type", "merges", "scores"):
            if key in tokenizer:
                w.add_array(f"tokenizer.ggml.{key}", tokenizer[key])
        w.add_uint32("tokenizer.ggml.bos_token_id", 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
        w.add_bool("tokenizer.ggml.add_bos_token", tokenizer["model"] == "llama")
        if "chat_template" in tokenizer:
            w.add_string("tokenizer.chat_template", tokenizer["chat_template"])
    for k, add in (keys or {}).items():
        add(w, k)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,),
              "blk.0.attn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d),
              "blk.0.attn_k.weight": (kv_heads * hd, d), "blk.0.attn_v.weight": (kv_heads * hd, d),
              "blk.0.attn_output.weight": (d, d), "blk.0.ffn_norm.weight": (d,),
              "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d),
              "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            if quantize:
                raw = quants.quantize(x, tensor_type)
            else:
                block, size = gguf.GGML_QUANT_SIZES[tensor_type]
                raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=tensor_type)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
