"""Hugging Face tokenizer.json files made from llama.cpp's real vocabularies.

llama.cpp's test data (llama_cpp_ref.ref_dir()) holds the vocabularies of real
models as ggml-vocab-NAME.gguf, without their tokenizer.json. write_tokenizer()
rebuilds the tokenizer.json (and tokenizer_config.json) those models publish:
the tokens, merges and token types come from the gguf; the pre-tokenizer
regexes, normalizers, decoders and post-processors are facts of each model,
written here as the published files have them. For the sentencepiece
vocabulary (Llama 2) the merges are rebuilt from the vocabulary and its scores
the way transformers' LlamaConverter (SentencePieceExtractor) builds them.
The test checks each file against the ids llama.cpp recorded from the original
Hugging Face tokenizer (.inp/.out), which validates the conversion.

    python gguf_tokenizer.py NAME OUT_DIR   (NAME: llama-bpe, llama-spm, qwen2, gpt-2)
"""
import json
import sys
from pathlib import Path

import gguf

# The Split regexes of Llama 3 and Qwen2 and GPT-2's ByteLevel one.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

NAMES = ["llama-bpe", "llama-spm", "qwen2", "gpt-2"]


def read_gguf(path):
    r = gguf.GGUFReader(str(path))
    get = lambda k: r.fields[k].contents() if k in r.fields else None  # noqa: E731
    return {
        "tokens": get("tokenizer.ggml.tokens"),
        "types": get("tokenizer.ggml.token_type"),
        "merges": get("tokenizer.ggml.merges"),
        "scores": get("tokenizer.ggml.scores"),
        "bos": get("tokenizer.ggml.bos_token_id"),
        "eos": get("tokenizer.ggml.eos_token_id"),
    }


def added(id_, content, special=True, normalized=False):
    return {"id": id_, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": normalized, "special": special}


def byte_level(add_prefix_space=False, trim_offsets=True, use_regex=True):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space,
            "trim_offsets": trim_offsets, "use_regex": use_regex}


def bpe(vocab, merges, **kw):
    m = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
         "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
         "ignore_merges": False, "vocab": vocab, "merges": merges}
    m.update(kw)
    return m


def template(bos):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": None, "tokens": [bos]}}}


def split_sequence(regex, trim_offsets):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        byte_level(False, trim_offsets, False)]}


def spm_merges(tokens, scores):
    """transformers' SentencePieceExtractor.extract(vocab_scores) (4.44)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    return [f"{a} {b}" for a, b, _ in merges]


def tokenizer_files(name, g, variant=None):
    """The tokenizer.json and tokenizer_config.json objects of `name`."""
    toks, types = g["tokens"], g["types"]
    if name == "llama-spm":
        vocab = {t: i for i, t in enumerate(toks)}
        specials = [added(i, toks[i]) for i in range(len(toks)) if types[i] in (2, 3)]
        tok = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": specials,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
            "pre_tokenizer": None,
            "post_processor": template("<s>"),
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": bpe(vocab, spm_merges(toks, g["scores"]), unk_token="<unk>",
                         fuse_unk=True, byte_fallback=True),
        }
        tok["post_processor"]["special_tokens"]["<s>"]["ids"] = [1]
        if variant == "metaspace":
            # transformers' non-legacy conversion: a Metaspace pre-tokenizer
            # instead of the normalizers; and a Metaspace decoder.
            tok["normalizer"] = None
            tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                    "prepend_scheme": "first", "split": False}
            tok["decoder"] = {"type": "Sequence", "decoders": [
                {"type": "ByteFallback"},
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                 "split": False}]}
        cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
        return tok, cfg
    # The BPE vocabularies over the ByteLevel alphabet. llama.cpp pads
    # Qwen2's vocabulary with [PAD...] tokens (type 4) the model does not have.
    normal = [i for i in range(len(toks)) if types[i] == 1]
    special = [i for i in range(len(toks)) if types[i] == 3]
    vocab = {toks[i]: i for i in normal}
    merges = list(g["merges"])
    if name == "llama-bpe":
        tok = {
            "added_tokens": [added(i, toks[i]) for i in special],
            "normalizer": None,
            "pre_tokenizer": split_sequence(LLAMA3_REGEX, True),
            "post_processor": {"type": "Sequence", "processors": [
                byte_level(True, False, True), template("<|begin_of_text|>")]},
            "decoder": byte_level(True, True, True),
            "model": bpe(vocab, merges, ignore_merges=True),
        }
        tok["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"] = [128000]
        cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    elif name == "qwen2":
        tok = {
            "added_tokens": [added(i, toks[i]) for i in special],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": split_sequence(QWEN2_REGEX, False),
            "post_processor": byte_level(False, False, False),
            "decoder": byte_level(False, False, False),
            "model": bpe(vocab, merges),
        }
        cfg = {"bos_token": None, "eos_token": "<|endoftext|>"}
    elif name == "gpt-2":
        for i in special:  # GPT-2's <|endoftext|> is in the model's vocabulary too
            vocab[toks[i]] = i
        tok = {
            "added_tokens": [added(i, toks[i], normalized=True) for i in special],
            "normalizer": None,
            "pre_tokenizer": byte_level(False, True, True),
            "post_processor": byte_level(True, False, True),
            "decoder": byte_level(False, True, True),
            "model": bpe(vocab, merges, continuing_subword_prefix="", end_of_word_suffix=""),
        }
        cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    else:
        raise ValueError(name)
    tok = {"version": "1.0", "truncation": None, "padding": None, **tok}
    return tok, cfg


def write_tokenizer(name, gguf_path, out_dir, variant=None):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, cfg = tokenizer_files(name, read_gguf(gguf_path), variant)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from llama_cpp_ref import ref_dir

    write_tokenizer(sys.argv[1], ref_dir() / f"ggml-vocab-{sys.argv[1]}.gguf", sys.argv[2],
                    sys.argv[3] if len(sys.argv) > 3 else None)
