"""kdn's CPU engine on quantized weights against llama.cpp on the same GGUF.

SmolLM2-135M-Instruct (Q4_1, token embedding Q8_0) kept in its formats
(`--weights-dtype native`: 8-bit activations, integer dot products) and
llama.cpp's CPU backend on the same file (llama_logits_ref, built by
tests/parity/llama_cpp_refs/build.sh, which scripts/install-deps.sh --ref
runs) both give the next-token logits of 20 prompts of real prose (Debian's
Apache-2.0 licence text, 6 to 200 tokens, llama.cpp's own token ids, so that
prompts of one and of several 64-row passes are covered). The two
quantize activations
differently (llama.cpp: Q8_1 blocks with f16 scales for Q4_1, its own
summation order, an f16 KV cache), so the logits are close, not equal:

  - top-1 agreement on all 20 prompts but near ties (llama.cpp's best and
    kdn's choice within 0.25 in llama.cpp's logits, an order its CPU's
    kernels decide), and on at least 18 exactly;
  - KL(llama.cpp || kdn native) per prompt and on average under bounds set
    from the measured spread (below);
  - the spread itself: kdn's f32 path (the weights widened, transformers'
    arithmetic to 1e-4 of the largest logit, tests/parity/test_gguf.py) is
    about as far from llama.cpp, so the native path is held to be no more
    than 1.5x farther on average, and within the same bounds of f32.
A wrong scale or a dropped block in a kernel moves these KLs by orders of
magnitude (tests/engine/quant_test.cpp checks the kernels themselves).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gguf_micro import smollm2_path  # noqa: E402
from llama_cpp_tokenize import llama_cpp_ids, refs_dir  # noqa: E402

BIN = Path(os.environ.get("KDN_BIN_DIR", HERE.parents[1] / "build" / "bin"))
LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
PROMPTS = 20
# Measured on the development machine (AMD EPYC, AVX-512 VNNI), 2026-11-28,
# nats per prompt: KL(llama.cpp || kdn native) mean 3.6e-3, max 9.2e-3;
# KL(llama.cpp || kdn f32) mean 3.6e-3, max 1.07e-2; KL(f32 || native) mean
# 1.2e-3, max 7.5e-3; top-1 equal everywhere. The bounds are twice the
# largest of these.
KL_MAX = 2.2e-2
KL_MEAN = 7.5e-3


def llama_logits_ref() -> Path:
    exe = refs_dir() / "bin" / "llama_logits_ref"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run scripts/install-deps.sh --ref or "
                    "tests/parity/llama_cpp_refs/build.sh")
    return exe


def prompts(model) -> list[list[int]]:
    """20 prompts of 6 to 200 tokens: consecutive paragraphs of the licence,
    each cut to a length that grows along the list."""
    paragraphs = [p.strip() for p in LICENSE.read_text().split("\n\n") if len(p.strip()) > 120]
    ids = llama_cpp_ids(model, paragraphs[:PROMPTS])
    lengths = np.linspace(6, 200, PROMPTS).astype(int)
    assert len(ids) == PROMPTS, f"{len(ids)} paragraphs"
    out = []
    for p, n in zip(ids, lengths):
        assert len(p) >= 6, "a paragraph of fewer than 6 tokens"
        out.append(p[:n])
    return out


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def kl(p_logits, q_logits):
    """KL(p || q) per row, in nats."""
    p, q = softmax(p_logits.astype(np.float64)), softmax(q_logits.astype(np.float64))
    return (p * (np.log(p + 1e-300) - np.log(q + 1e-300))).sum(axis=-1)


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    model = smollm2_path()
    tmp = tmp_path_factory.mktemp("llama-logits")
    ps = prompts(model)
    lines = tmp / "prompts.txt"
    lines.write_text("".join(",".join(map(str, p)) + "\n" for p in ps))
    got = {}
    subprocess.run([str(llama_logits_ref()), str(model), "1", str(lines), str(tmp / "llama.f32")],
                   check=True, timeout=600)
    got["llama"] = np.fromfile(tmp / "llama.f32", dtype=np.float32)
    for dtype in ("native", "f32"):
        subprocess.run([str(BIN / "kdn_forward"), "--next", str(model), str(lines),
                        str(tmp / f"{dtype}.f32"), dtype], check=True, timeout=600)
        got[dtype] = np.fromfile(tmp / f"{dtype}.f32", dtype=np.float32)
    return {k: v.reshape(len(ps), -1) for k, v in got.items()}


# Where llama.cpp's own top two are this close, its rounding decides the
# order, and that rounding changes with the CPU it was built for (AVX2 or
# AVX-512 kernels): on an AVX2 machine one prompt's top two, 0.13 apart in
# llama.cpp, come out the other way round in kdn's native path and in kdn's
# f32 path (transformers' arithmetic) alike.
NEAR_TIE = 0.25


def test_top1_agrees_with_llama_cpp_on_every_prompt(logits):
    llama, native = logits["llama"], logits["native"]
    exact = native.argmax(-1) == llama.argmax(-1)
    # kdn's choice is llama.cpp's, or within NEAR_TIE of llama.cpp's best.
    picked = llama[np.arange(len(llama)), native.argmax(-1)]
    close = llama.max(-1) - picked <= NEAR_TIE
    assert (exact | close).all(), f"top-1 disagreements beyond a near tie: {(~(exact | close)).sum()}"
    assert exact.mean() >= 0.9, f"top-1 agreement {exact.mean():.2f} over {PROMPTS} prompts"


def test_kl_to_llama_cpp_is_under_the_bounds(logits):
    d = kl(logits["llama"], logits["native"])
    print("KL(llama.cpp || kdn native): mean %.2e, max %.2e" % (d.mean(), d.max()))
    assert d.max() < KL_MAX and d.mean() < KL_MEAN, f"KL per prompt {d}"


def test_native_is_as_near_llama_cpp_as_f32_and_near_f32(logits):
    to_f32 = kl(logits["f32"], logits["native"])
    print("KL(kdn f32 || kdn native): mean %.2e, max %.2e" % (to_f32.mean(), to_f32.max()))
    assert to_f32.max() < KL_MAX and to_f32.mean() < KL_MEAN, f"per prompt {to_f32}"
    native_llama = kl(logits["llama"], logits["native"]).mean()
    f32_llama = kl(logits["llama"], logits["f32"]).mean()
    print("mean KL to llama.cpp: native %.2e, f32 %.2e" % (native_llama, f32_llama))
    assert native_llama < 1.5 * f32_llama
