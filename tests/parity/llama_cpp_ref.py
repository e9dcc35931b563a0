"""Where the real vocabularies and chat templates of llama.cpp's test data are.

scripts/install-deps.sh --ref unpacks them from the pinned llama-cpp-python
source archive (PyPI) to ~/.cache/kdn; KDN_LLAMA_CPP_REF names another place.
The folder holds ggml-vocab-NAME.gguf (with .inp/.out: test inputs and the ids
the original Hugging Face tokenizer gave them) and templates/*.jinja.
"""

import os
from pathlib import Path

import pytest

VERSION = "0.3.36"


def ref_dir() -> Path:
    d = Path(os.environ.get("KDN_LLAMA_CPP_REF",
                            Path.home() / ".cache" / "kdn" / f"llama-cpp-python-{VERSION}"))
    if not (d / ".complete").exists():
        pytest.fail(f"{d}: llama.cpp's reference vocabularies are missing; "
                    "run scripts/install-deps.sh --ref")
    return d
