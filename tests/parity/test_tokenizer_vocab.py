"""kdn's tokenizer against Hugging Face `tokenizers` on real vocabularies.

For Llama 3 (llama-bpe), Llama 2 (llama-spm, sentencepiece BPE with byte
fallback; also in transformers' non-legacy Metaspace form), Qwen2 and GPT-2,
gguf_tokenizer.py rebuilds the tokenizer.json from llama.cpp's gguf
vocabulary. Then:
  (a) `tokenizers` on that file gives the ids llama.cpp recorded from the
      original Hugging Face tokenizer (.inp/.out): the conversion is right;
  (b) kdn gives those ids too;
  (c) kdn gives the ids `tokenizers` gives on a larger corpus (code, many
      scripts, emoji, whitespace runs, special-token strings, numbers,
      contractions, decomposed accents, random mixtures), with and without
      the special tokens the post-processor adds;
  (d) kdn's Decode equals `tokenizers`' decode (skip_special_tokens) of those
      ids and of random id sequences (partial UTF-8 characters, runs of
      byte-fallback tokens that are and are not valid UTF-8), and decoding
      one token at a time (DecodeStream) gives exactly the same text.
kdn runs as one kdn_tokenize process per vocabulary (KDN_BIN_DIR).
"""
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gguf_tokenizer import write_tokenizer
from llama_cpp_ref import ref_dir

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))

# (vocabulary, variant): the variant changes the tokenizer.json's form only.
VOCABS = [("llama-bpe", None), ("llama-spm", None), ("llama-spm", "metaspace"), ("qwen2", None),
          ("gpt-2", None)]

CORPUS = [
    "Hello world", " Hello world", "Hello World!", "hello, world... how are you?",
    "I'm sure they'll say it's what we've done; DON'T, WON'T, Isn't, We'D, you'RE",
    "The year 2024 had 366 days; pi is 3.14159265358979 and 1,000,000 > 999999.",
    "12345678901234567890 0.5 -17 +3e-10 0x1F 1e100 ١٢٣ ४५६ 七八九",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body><div class=\"x\">Text &amp; more</div></body></html>",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "   leading spaces", "trailing spaces   ", "a    b     c", "\t\ttabs\tand\tspaces ",
    "\n", "\n\n\n", " \n \n ", "line1\r\nline2\r\n", "\u00a0non-breaking\u00a0space", "\u3000全角",
    "next\u0085line", "line\u2028separator", "\x00\x01\x1f\x7f control",
    "我爱自然语言处理。今天天气很好！", "日本語のテキストです。カタカナとひらがな。",
    "안녕하세요, 세계! 반갑습니다.", "مرحبا بالعالم، كيف حالك؟", "שלום עולם", "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Как дела? Всё хорошо.", "Καλημέρα κόσμε", "สวัสดีชาวโลก", "Tiếng Việt có dấu",
    "Ελληνικά and English and Русский mixed 混合 text",
    "🦙🔥👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️ ✨", "emoji🙂inside🙃words",
    "Cafe\u0301 vs Café, A\u030a vs Å, ﬁ ligature, ① circled, Ｆｕｌｌ width",
    "<|begin_of_text|>Hello<|end_of_text|>", "<s> hi </s>", "<s>hi</s>", " <s>", "<unk>",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text", "<|endoftext|><|endoftext|>", "<|reserved_special_token_3|>",
    "a" * 300, " " * 64, "ab " * 100, "1" * 40, "ha" * 50 + "!", "x\u0301" * 20,
    "The quick brown fox jumps over the lazy dog. " * 5,
]

# Characters the random mixtures are drawn from: several scripts, digits,
# punctuation, spaces of several kinds, emoji, combining marks.
POOL = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        " \t\n\r   .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"
        "éèüßøåñçÉÜ漢字中文語言日本한국어ÀЖжЯяαβγאבגابتनमस्ते"
        "🦙🔥👍🏽\u200d\u0301\u00a0\u3000\u0085")


def random_id_sequences(hf, n, rng):
    """n random id sequences of `hf`'s vocabulary: cut characters, stray
    bytes, and half of them with a run of byte-fallback tokens (where the
    vocabulary has them) inserted, valid UTF-8 or not."""
    size = hf.get_vocab_size()
    byte_tokens = [t for t in (hf.token_to_id(f"<0x{b:02X}>") for b in range(256)) if t is not None]
    seqs = []
    for _ in range(n):
        seq = [rng.randrange(size) for _ in range(rng.randint(1, 12))]
        if byte_tokens and rng.random() < 0.5:
            at = rng.randint(0, len(seq))
            seq[at:at] = [rng.choice(byte_tokens) for _ in range(rng.randint(1, 5))]
        seqs.append(seq)
    return seqs


def random_texts(n, seed):
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        k = rng.randint(1, 80)
        texts.append("".join(rng.choice(POOL) for _ in range(k)))
    return texts


class Kdn:
    """One kdn_tokenize process answering JSON lines."""

    def __init__(self, folder):
        self.p = subprocess.Popen([str(BIN / "kdn_tokenize"), str(folder)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, encoding="utf-8")

    def ask(self, req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, "kdn_tokenize ended"
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def encode(self, text, add_bos=False):
        return self.ask({"encode": text, "add_bos": add_bos})["ids"]

    def decode(self, ids):
        return self.ask({"decode": ids})

    def close(self):
        self.p.stdin.close()
        self.p.wait()


@pytest.fixture(scope="module", params=VOCABS, ids=lambda v: v[0] + ("-" + v[1] if v[1] else ""))
def vocab(request, tmp_path_factory):
    name, variant = request.param
    folder = write_tokenizer(name, ref_dir() / f"ggml-vocab-{name}.gguf",
                             tmp_path_factory.mktemp(name), variant)
    kdn = Kdn(folder)
    yield name, variant, Tokenizer.from_file(str(folder / "tokenizer.json")), kdn
    kdn.close()


def reference_cases(name):
    base = ref_dir() / f"ggml-vocab-{name}.gguf"
    inputs = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(outputs)
    return [(t, [int(x) for x in o.split()]) for t, o in zip(inputs, outputs)]


def test_ids_equal_the_original_tokenizers_recorded_by_llama_cpp(vocab):
    name, variant, hf, kdn = vocab
    if variant:
        pytest.skip("the recorded ids are those of the published (legacy) form")
    cases = reference_cases(name)
    assert len(cases) > 40
    for text, want in cases:
        assert hf.encode(text, add_special_tokens=False).ids == want, f"conversion: {text!r}"
        assert kdn.encode(text) == want, text


def test_ids_equal_tokenizers_on_a_larger_corpus(vocab):
    _, _, hf, kdn = vocab
    # The whole corpus as one text too: without a pre-tokenizer (Llama 2)
    # it is one long word for BPE.
    for text in CORPUS + random_texts(300, seed=7) + [" ".join(CORPUS + random_texts(50, seed=6))]:
        assert kdn.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert kdn.encode(text, add_bos=True) == hf.encode(text).ids, text


def test_decode_and_streaming_decode_equal_tokenizers(vocab):
    name, _, hf, kdn = vocab
    seqs = [hf.encode(t).ids for t in CORPUS + random_texts(100, seed=8)]
    rng = random.Random(9)
    byte_tokens = [hf.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    byte_tokens = [t for t in byte_tokens if t is not None]
    seqs += random_id_sequences(hf, 300, rng)
    if byte_tokens:
        # "é" (C3 A9) and "🦙" (F0 9F A6 99) as fallback runs, whole and cut.
        b = lambda x: hf.token_to_id(f"<0x{x:02X}>")  # noqa: E731
        seqs += [[b(0xC3), b(0xA9)], [b(0xF0), b(0x9F), b(0xA6), b(0x99)], [b(0xF0), b(0x9F)],
                 [b(0xC3)] + hf.encode(" x").ids, hf.encode(" y").ids + [b(0xE4), b(0xB8)]]
    for ids in seqs:
        got = kdn.decode(ids)
        want = hf.decode(ids, skip_special_tokens=True)
        assert got["text"] == want, (name, ids)
        assert got["stream"] == got["text"], (name, ids, got["pieces"])


def test_streaming_holds_a_split_character_back_until_it_completes(vocab):
    name, _, hf, kdn = vocab
    # An Egyptian hieroglyph: split over several tokens (bytes, pieces of
    # bytes, or byte-fallback tokens) in each of these vocabularies.
    ids = hf.encode("\U00013000", add_special_tokens=False).ids
    assert len(ids) >= 3
    pieces = kdn.decode(ids)["pieces"]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces).strip() == "\U00013000"
    assert all(p == "" for p in pieces[:-2]), pieces  # nothing shows before the last byte
