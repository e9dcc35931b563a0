"""CudaModel against Hugging Face transformers on the same GPU, both in bf16
(sdpa attention), on generated models: logits within bf16 noise of each other
(3% of the largest logit) and the same greedy tokens until the first step
where transformers' own top two are within that noise. Skipped without a GPU.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def run(*args):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True).stdout


def check_against(model, ids, logits_file, kdn_tokens, label):
    """kdn's logits of `ids` (logits_file) within bf16 noise of the model's
    (3% of the largest), and its greedy tokens the model's until the first
    step where the model's own top two are within that noise."""
    kdn_logits = np.fromfile(logits_file, dtype=np.float32).reshape(len(ids), -1)
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
        scale = np.abs(ref).max()
        err = np.abs(kdn_logits - ref).max() / scale
        print(f"\n{label}: max |kdn - hf| / max |hf| = {err:.2e} (transformers {transformers.__version__})")
        assert err < 3e-2
        seq = list(ids)
        for step in range(len(kdn_tokens)):
            logits = model(torch.tensor([seq], device="cuda")).logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            if (top2.values[0] - top2.values[1]).item() < 0.01 * scale:
                break  # a near tie: bf16 noise may pick either
            assert kdn_tokens[step] == int(top2.indices[0]), f"step {step}"
            seq.append(int(top2.indices[0]))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "small"])
def test_cuda_logits_and_greedy_tokens_match_transformers(preset, tmp_path):
    model_dir = tmp_path / preset
    run(BIN / "kdn-mkmodel", "--preset", preset, "--seed", "11", "--out", model_dir,
        "--dtype", "bf16")
    ids = [256] + [(i * 37 + 11) % 256 for i in range(299)]
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward_cuda", model_dir, ",".join(map(str, ids)), out, 16)
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    check_against(model, ids, out, kdn_tokens, preset)


# The RoPE types and sliding windows of tests/parity/test_rope_window.py, on
# the CUDA engine (windowed models on its reference attention kernels).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from test_rope_window import CASES, make_model, prompt_ids  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_rope_types_and_windows_match_transformers(case, tmp_path):
    preset, changes, needs_tf5 = CASES[case]
    if needs_tf5 and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__} reads this config as 4.x did")
    model_dir, cfg = make_model(tmp_path, preset, changes)
    ids = prompt_ids(300)
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward_cuda", model_dir, ",".join(map(str, ids)), out, 16)
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16,
                                                 attn_implementation="eager").cuda().eval()
    rope = changes.get("rope_scaling") or changes.get("rope_parameters") or {}
    split = cfg["max_position_embeddings"] if rope.get("rope_type", rope.get("type")) == "dynamic" \
        else len(ids)
    with torch.no_grad():
        # Dynamic RoPE: one token per pass past the threshold (see the parity test).
        res = model(torch.tensor([ids[:split]], device="cuda"), use_cache=True)
        rows, past = [res.logits[0].float()], res.past_key_values
        for t in ids[split:]:
            res = model(torch.tensor([[t]], device="cuda"), past_key_values=past, use_cache=True)
            rows.append(res.logits[0].float())
            past = res.past_key_values
        ref = torch.cat(rows).cpu().numpy()
        kdn_logits = np.fromfile(out, dtype=np.float32).reshape(len(ids), model.config.vocab_size)
        scale = np.abs(ref).max()
        err = np.abs(kdn_logits - ref).max() / scale
        print(f"\n{case}: max |kdn - hf| / max |hf| = {err:.2e} (transformers {transformers.__version__})")
        assert err < 3e-2
        for step in range(16):
            logits = res.logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            if (top2.values[0] - top2.values[1]).item() < 0.01 * scale:
                break  # a near tie: bf16 noise may pick either
            assert kdn_tokens[step] == int(top2.indices[0]), f"step {step}"
            res = model(top2.indices[:1].view(1, 1), past_key_values=past, use_cache=True)
            past = res.past_key_values


def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh; KDN_SMOLLM2
    names another copy), or a skip where neither is here."""
    p = Path(os.environ.get("KDN_SMOLLM2",
                            Path.home() / ".cache" / "kdn" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not p.is_file():
        pytest.skip(f"{p}: no SmolLM2 GGUF here (scripts/fetch-smollm2.sh)")
    return p


def test_cuda_smollm2_gguf_matches_transformers(tmp_path):
    """A real model as users ship it (Q4_1 GGUF, head_dim 64: the FlashInfer
    path) on the CUDA engine, against transformers' own GGUF loader and
    tokenizer, both in bf16 on the same GPU."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer
    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = ("<|im_start|>user\nThe lighthouse of Varn was built in 1887 and is painted red "
            "and white. Its keeper, Anna Lind, lit the lamp every evening for thirty-one "
            "years. Who kept the lighthouse, and for how long? Answer in one sentence, then "
            "describe the lighthouse in a few more sentences.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward_cuda", path, ",".join(map(str, ids)), out, 16)
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    check_against(model, ids, out, kdn_tokens, f"SmolLM2 ({len(ids)} tokens)")
