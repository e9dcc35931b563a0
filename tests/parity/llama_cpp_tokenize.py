"""llama.cpp's own tokenizer on a GGUF file, as a reference for kdn's.

llama_tokenize_ref (tests/parity/llama_cpp_refs/) is built from the
vendored llama.cpp of the pinned llama-cpp-python source archive by
scripts/install-deps.sh --ref, into ~/.cache/kdn/llama-cpp-refs-VERSION
beside llama_logits_ref; KDN_LLAMA_CPP_REFS names another place. One process serves a whole list
of texts (or id lists) for one GGUF file.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

VERSION = "0.3.36"


def refs_dir() -> Path:
    """Where tests/parity/llama_cpp_refs/build.sh put llama.cpp's programs."""
    return Path(os.environ.get("KDN_LLAMA_CPP_REFS",
                               Path.home() / ".cache" / "kdn" / f"llama-cpp-refs-{VERSION}"))


def driver() -> Path:
    d = refs_dir()
    exe = d / "bin" / "llama_tokenize_ref"
    if not (d / ".complete").exists() or not exe.exists():
        pytest.fail(f"{d}: llama.cpp's tokenizer (llama_tokenize_ref) is missing; run "
                    "scripts/install-deps.sh --ref or tests/parity/llama_cpp_refs/build.sh")
    return exe


def _run(gguf_path, requests) -> list[dict]:
    """One llama_tokenize_ref process over requests (dicts, see its header)."""
    lines = "".join(json.dumps(r) + "\n" for r in requests).encode()
    proc = subprocess.run([str(driver()), str(gguf_path)], input=lines, capture_output=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama_tokenize_ref {gguf_path} exited {proc.returncode}: "
                           f"{proc.stderr.decode(errors='replace')}")
    # split("\n"), not splitlines(): the JSON holds raw U+0085 and U+2028.
    out = [json.loads(line) for line in proc.stdout.decode().split("\n") if line]
    if len(out) != len(requests):
        raise RuntimeError(f"llama_tokenize_ref answered {len(out)} of {len(requests)} requests")
    return out


def llama_cpp_tokenize(gguf_path, texts, add_special=False, parse_special=False) -> list[dict]:
    """For each text: {"ids", "text", "text_special"}: llama_tokenize's ids and
    llama_detokenize of them without and with control tokens rendered."""
    return _run(gguf_path, [{"text": t, "add_special": add_special,
                             "parse_special": parse_special} for t in texts])


def llama_cpp_ids(gguf_path, texts, add_special=False, parse_special=False) -> list[list[int]]:
    """llama_tokenize(vocab, text, add_special, parse_special) for each text."""
    return [r["ids"] for r in llama_cpp_tokenize(gguf_path, texts, add_special, parse_special)]


def llama_cpp_decode(gguf_path, id_lists, unparse_special=False) -> list[str]:
    """llama_detokenize(vocab, ids, remove_special=false, unparse_special) for
    each id list; bytes that are not UTF-8 come back as U+FFFD."""
    key = "text_special" if unparse_special else "text"
    return [r[key] for r in _run(gguf_path, [{"ids": list(ids)} for ids in id_lists])]
