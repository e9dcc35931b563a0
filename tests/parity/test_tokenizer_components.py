"""kdn's pre-tokenizers and decoders against Hugging Face `tokenizers`.

Each variant is a real vocabulary (GPT-2's byte-level BPE, Llama 2's
sentencepiece BPE; gguf_tokenizer.py rebuilds their tokenizer.json) with its
pre-tokenizer or its decoder swapped for another that `tokenizers` accepts:
Digits, Punctuation (every behavior), Whitespace and WhitespaceSplit alone and
in Sequences with Split, ByteLevel and Metaspace (SmolLM2's Digits +
ByteLevel among them); decoder Sequences in orders real files do not use
(Replace, Metaspace, Strip, ByteFallback, ByteLevel after Fuse or ByteLevel,
ByteLevel twice). For each, kdn must give the ids `tokenizers` gives on a
corpus of numbers, code, several scripts, emoji, whitespace and punctuation
runs, and decode (whole, and one token at a time) to the text it decodes.
"""
import json
import random

import pytest
from tokenizers import Tokenizer

from gguf_tokenizer import read_gguf, tokenizer_files
from llama_cpp_ref import ref_dir
from test_tokenizer_vocab import CORPUS, Kdn, random_id_sequences, random_texts

EXTRA = [
    "12345", "3.14", "1,000,000", "-42.5e3", "v1.2.3-rc4", "2024-01-31T12:00:00Z", "0x7fff_ffff",
    "١٢٣٫٤٥ ٣.١٤ ४२ 〇一二 ①②③ ½¾ ² Ⅻ ⅷ",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // 3 ops",
    "x=1;y=2\tz=3\n\n\tw = x**2 // y % z",
    "?!?!...---...!!! <<>> ((())) ::= ->> ~~ `code` \"quoted\" 'single'",
    "«quoted» „German“ ¿Qué? ¡Sí! 「日本」『語』 【注】 —dash– … ‰ §1 ¶",
    "a_b foo__bar __init__ snake_case_name $var @user #tag 50% a&b a|b",
    "naïve café résumé Ångström Øresund ﬁnal Straße",
    "中文，标点。问号？感叹！（括号）“引号”：冒号；",
    "emoji 🦙🦙 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ 1️⃣ #️⃣",
    "   ", "\t", "\n \n", " \t \n ", "a\u00a0\u00a0b", "x\u2003y\u3000z", "\u180ex\u200by\u200dz",
    "Ⓐ circled Ⓩ ⓐ, ㊀ ㋐, ℃ ™ ©",
    "<0x41><0xC3><0xA9> <0x41>", "<0x41>", "<0xe9>", "▁x▁▁y ▁", "Ġhello Ċ",
]

# A random mixture rich in digits, punctuation and spaces.
POOL = "0123456789.,;:!?-_()[]{}'\" \t\n\u00a0\u3000abcXYZéß中文🦙①½٣"


def numbers_and_punctuation(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def byte_level(add_prefix_space=False, use_regex=True):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
            "use_regex": use_regex}


def seq_pre(*p):
    return {"type": "Sequence", "pretokenizers": list(p)}


def seq_dec(*d):
    return {"type": "Sequence", "decoders": list(d)}


def digits(individual):
    return {"type": "Digits", "individual_digits": individual}


def punct(behavior=None):
    return {"type": "Punctuation", **({"behavior": behavior} if behavior else {})}


WHITESPACE = {"type": "Whitespace"}
WHITESPACE_SPLIT = {"type": "WhitespaceSplit"}
FUSE = {"type": "Fuse"}
BYTE_FALLBACK = {"type": "ByteFallback"}


def metaspace(prepend="first", split=True):
    return {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": prepend, "split": split}


def replace(old, new, regex=False):
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": old}, "content": new}


def strip(content, start, stop):
    return {"type": "Strip", "content": content, "start": start, "stop": stop}


LLAMA3_SPLIT = {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {
    "Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}}

# name: (vocabulary, {field: replacement}). GPT-2's decoder is ByteLevel and
# Llama 2's (metaspace form) Sequence[ByteFallback, Metaspace] unless swapped.
VARIANTS = {
    # Pre-tokenizers over GPT-2's byte-level vocabulary.
    "smollm2-digits-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(digits(True), byte_level())}),
    "digit-runs-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(digits(False), byte_level())}),
    "digits-split-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(
        digits(True), LLAMA3_SPLIT, byte_level(use_regex=False))}),
    "punct-default": ("gpt-2", {"pre_tokenizer": seq_pre(punct(), byte_level(use_regex=False))}),
    **{f"punct-{b}": ("gpt-2", {"pre_tokenizer": seq_pre(punct(b), byte_level(use_regex=False))})
       for b in ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"]},
    "whitespace-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(WHITESPACE, byte_level(use_regex=False))}),
    "whitespacesplit-prefix-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(
        WHITESPACE_SPLIT, byte_level(add_prefix_space=True, use_regex=False))}),
    "whitespace-digits-punct-bytelevel": ("gpt-2", {"pre_tokenizer": seq_pre(
        WHITESPACE_SPLIT, punct("Contiguous"), digits(False), byte_level(use_regex=True))}),
    # No ByteLevel: words looked up as they are (no unk: what has no token goes).
    "whitespace-alone": ("gpt-2", {"pre_tokenizer": WHITESPACE, "decoder": FUSE}),
    "nested-sequence": ("gpt-2", {"pre_tokenizer": seq_pre(seq_pre(WHITESPACE_SPLIT, digits(True)),
                                                           seq_pre(punct("MergedWithNext"))),
                                  "decoder": None}),
    # Pre-tokenizers with Metaspace over Llama 2's sentencepiece vocabulary.
    "digits-metaspace": ("llama-spm", {"pre_tokenizer": seq_pre(digits(True), metaspace("first", False))}),
    "whitespacesplit-metaspace-always": ("llama-spm", {"pre_tokenizer": seq_pre(
        WHITESPACE_SPLIT, metaspace("always", True))}),
    "metaspace-then-punct-digits": ("llama-spm", {"pre_tokenizer": seq_pre(
        metaspace("first", True), punct("MergedWithPrevious"), digits(False))}),
    "whitespace-metaspace-never": ("llama-spm", {"pre_tokenizer": seq_pre(WHITESPACE, metaspace("never", True))}),
    # Decoder orders over Llama 2's vocabulary.
    "dec-fallback-fuse-replace-strip": ("llama-spm", {"decoder": seq_dec(
        BYTE_FALLBACK, FUSE, replace("\u2581", " "), strip(" ", 1, 0))}),
    "dec-fuse-metaspace": ("llama-spm", {"decoder": seq_dec(BYTE_FALLBACK, FUSE, metaspace())}),
    "dec-fuse-metaspace-never": ("llama-spm", {"decoder": seq_dec(FUSE, metaspace("never"), BYTE_FALLBACK)}),
    "dec-metaspace-strip-fallback-fuse": ("llama-spm", {"decoder": seq_dec(
        metaspace("always"), strip(" ", 2, 0), BYTE_FALLBACK, FUSE)}),
    "dec-replace-regex-after-fuse": ("llama-spm", {"decoder": seq_dec(
        BYTE_FALLBACK, FUSE, replace("\u2581+", "_", regex=True), replace("_e", "E"))}),
    "dec-two-char-replace-after-fuse": ("llama-spm", {"decoder": seq_dec(
        BYTE_FALLBACK, FUSE, replace("\u2581\u2581", "<2>"), replace("\u2581", " "))}),
    "dec-fuse-then-bytelevel": ("llama-spm", {"decoder": seq_dec(FUSE, byte_level(), BYTE_FALLBACK)}),
    "dec-none": ("llama-spm", {"decoder": None}),
    # Decoder orders over GPT-2's vocabulary.
    "dec-fuse-bytelevel": ("gpt-2", {"decoder": seq_dec(FUSE, byte_level())}),
    "dec-bytelevel-twice": ("gpt-2", {"decoder": seq_dec(byte_level(), byte_level())}),
    "dec-replace-then-bytelevel": ("gpt-2", {"decoder": seq_dec(replace("\u0120", " "), byte_level())}),
    "dec-bytelevel-then-fallback": ("gpt-2", {"decoder": seq_dec(byte_level(), FUSE, BYTE_FALLBACK)}),
    "dec-bytelevel-then-edits": ("gpt-2", {"decoder": seq_dec(
        byte_level(), strip(" ", 1, 0), replace("  ", "\u00b7"), metaspace("always"),
        replace(r"\d+", "#", regex=True))}),
    "dec-metaspace-then-bytelevel": ("gpt-2", {"decoder": seq_dec(metaspace(), strip("\u0120", 1, 0), byte_level())}),
}


def panics(f, *args, **kw):
    """f(*args, **kw), or None where `tokenizers` panics (Strip on too short a text)."""
    try:
        return f(*args, **kw)
    except BaseException as e:  # pyo3's PanicException is a BaseException
        if type(e).__name__ != "PanicException":
            raise
        return None


@pytest.fixture(scope="module")
def gguf_vocabs():
    return {name: read_gguf(ref_dir() / f"ggml-vocab-{name}.gguf") for name in ("gpt-2", "llama-spm")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, gguf_vocabs, tmp_path_factory):
    name = request.param
    vocab, swap = VARIANTS[name]
    tok, cfg = tokenizer_files(vocab, gguf_vocabs[vocab], "metaspace" if vocab == "llama-spm" else None)
    tok.update(swap)
    folder = tmp_path_factory.mktemp(name)
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))  # `tokenizers` accepts it
    kdn = Kdn(folder)
    yield name, hf, kdn
    kdn.close()


def texts():
    return CORPUS + EXTRA + numbers_and_punctuation(150, seed=11) + random_texts(100, seed=12)


def test_ids_equal_tokenizers(variant):
    name, hf, kdn = variant
    for text in texts() + [" ".join(EXTRA)]:
        assert kdn.encode(text) == hf.encode(text, add_special_tokens=False).ids, (name, text)
        assert kdn.encode(text, add_bos=True) == hf.encode(text).ids, (name, text)


def test_decode_and_streaming_decode_equal_tokenizers(variant):
    name, hf, kdn = variant
    seqs = [hf.encode(t, add_special_tokens=False).ids for t in texts()]
    seqs += random_id_sequences(hf, 200, random.Random(13))
    compared = 0
    for ids in seqs:
        want = panics(hf.decode, ids, skip_special_tokens=True)
        if want is None:
            continue
        got = kdn.decode(ids)
        assert got["text"] == want, (name, ids)
        assert got["stream"] == want, (name, ids, got["pieces"])
        compared += 1
    assert compared > len(seqs) * 0.9
