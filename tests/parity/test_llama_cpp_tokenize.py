"""llama_tokenize_ref, the llama.cpp tokenizer kdn's GGUF tokenizer is held
to, against what llama.cpp's own test data says it must give.

(a) For each real vocabulary of llama.cpp's test data (ggml-vocab-NAME.gguf
    with .inp/.out: inputs and the ids the original Hugging Face tokenizer gave
    them), the driver's ids equal the recorded ones, with add_special and
    parse_special off as llama.cpp's tests/test-tokenizer-0.cpp runs them.
(b) add_special and parse_special reach llama.cpp: BOS is prepended where the
    vocabulary asks for it, a special token's text becomes that token only
    when parse_special is on, and detokenizing renders control tokens only
    when asked.
"""
import pytest

from llama_cpp_ref import ref_dir
from llama_cpp_tokenize import llama_cpp_decode, llama_cpp_ids, llama_cpp_tokenize

# Every ggml-vocab-*.gguf with .inp/.out in llama-cpp-python 0.3.36.
VOCABS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
          "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]


def read_cases(name):
    """(input, ids) pairs, split as test-tokenizer-0.cpp splits them: bytes, so
    that a \\r in an input stays one."""
    base = ref_dir() / f"ggml-vocab-{name}.gguf"
    raw = base.with_suffix(".gguf.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs = raw.split(sep)
    if raw.endswith(sep):
        inputs.pop()
    outputs = base.with_suffix(".gguf.out").read_bytes().decode("utf-8").split("\n")
    if outputs and outputs[-1] == "":
        outputs.pop()
    assert len(inputs) == len(outputs), name
    return base, [(t, [int(x) for x in o.split()]) for t, o in zip(inputs, outputs)]


@pytest.mark.parametrize("name", VOCABS)
def test_ids_equal_hugging_face_on_llama_cpp_test_data(name):
    gguf, cases = read_cases(name)
    got = llama_cpp_ids(gguf, [t for t, _ in cases])
    bad = [(t, want, ids) for (t, want), ids in zip(cases, got) if ids != want]
    assert not bad, f"{len(bad)} of {len(cases)} differ, first: {bad[0]!r}"


def test_add_special_and_parse_special_reach_llama_cpp():
    gguf = ref_dir() / "ggml-vocab-llama-bpe.gguf"
    bos = 128000  # <|begin_of_text|>
    text = "<|begin_of_text|>Hello world"
    [plain] = llama_cpp_ids(gguf, ["Hello world"])
    [as_text] = llama_cpp_ids(gguf, [text])
    [parsed] = llama_cpp_ids(gguf, [text], parse_special=True)
    [with_bos] = llama_cpp_ids(gguf, ["Hello world"], add_special=True)
    assert bos not in plain and bos not in as_text and len(as_text) > len(plain) + 1
    assert parsed == [bos] + plain
    assert with_bos == [bos] + plain
    [r] = llama_cpp_tokenize(gguf, [text], parse_special=True)
    assert r["text"] == "Hello world" and r["text_special"] == text
    assert llama_cpp_decode(gguf, [parsed, as_text], unparse_special=True) == [text, text]


def test_sentencepiece_vocabulary_adds_bos_and_a_space_prefix():
    gguf = ref_dir() / "ggml-vocab-llama-spm.gguf"
    [plain] = llama_cpp_ids(gguf, ["Hello"])
    [with_bos] = llama_cpp_ids(gguf, ["Hello"], add_special=True)
    assert with_bos == [1] + plain  # <s>
    [r] = llama_cpp_tokenize(gguf, ["Hello"])
    assert r["text"] == "Hello"  # the prefixed space is dropped again
