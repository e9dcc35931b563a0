"""RoPE scaling types and sliding windows against Hugging Face transformers.

Each case is a generated model (kdn-mkmodel) whose config.json is then given a
rope_scaling (or rope_parameters) and/or a sliding window; transformers and
kdn's CPU engine load the same folder. kdn must agree on the logits of every
position of a 300-token prompt (1e-4 relative to the largest logit) and on 24
greedy tokens.

kdn follows the current transformers (5.x) where releases disagree
(docs/engine.md, "RoPE"): 4.x ignores rope_scaling on Mistral and Qwen2, lets
"type" override "rope_type", reads no rope_parameters, takes yarn's
correction range from max_position_embeddings, and builds no Qwen2 sliding
window outside FlashAttention. Those cases run only where transformers >= 5
is installed (the GPU host's 5.17; tests/cuda/test_hf_cuda.py runs them on
the CUDA engine there), the rest everywhere.

Dynamic RoPE: transformers recomputes the frequencies per forward pass from
its last position; kdn gives each token its own (as transformers does when it
generates one token per pass), so the reference here is transformers run one
token at a time past the threshold.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))
TF5 = int(transformers.__version__.split(".")[0]) >= 5
PROMPT = 300
GREEDY = 24

# id: (preset, config.json changes, needs transformers 5)
CASES = {
    "llama-linear": ("tiny", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, False),
    "llama-dynamic": ("tiny", {"rope_scaling": {"type": "dynamic", "factor": 3.0},
                               "max_position_embeddings": 128}, False),
    "llama-yarn": ("tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, False),
    "llama-yarn-original": ("tiny", {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
        "beta_fast": 16, "mscale": 0.8, "mscale_all_dim": 0.5}}, True),
    "llama-rope-parameters": ("tiny", {"rope_scaling": None, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}, True),
    "llama-rope-type-first": ("tiny", {"rope_scaling": {
        "type": "linear", "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}, True),
    "mistral-window": ("tiny-mistral", {"sliding_window": 64}, False),
    "mistral-yarn-window": ("tiny-mistral", {"sliding_window": 100, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}, True),
    "mistral-dynamic": ("tiny-mistral", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                                         "max_position_embeddings": 200}, True),
    "qwen2-window-layers": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 48,
                                           "max_window_layers": 1}, True),
    "qwen2-llama3": ("tiny-qwen2", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}, True),
}


def run(*args):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True).stdout


def make_model(tmp_path, preset, changes):
    out = tmp_path / "model"
    run(BIN / "kdn-mkmodel", "--preset", preset, "--seed", "5", "--out", out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, cfg


def prompt_ids(n):
    return [256] + [(i * 37 + 11) % 256 for i in range(n - 1)]


def hf_logits_and_greedy(model, ids, dynamic_from):
    """Logits of every prompt position and greedy tokens. With dynamic RoPE,
    one token per pass from `dynamic_from` on, with the cache."""
    with torch.no_grad():
        if dynamic_from is None:
            ref = model(torch.tensor([ids])).logits[0].numpy()
            seq = list(ids)
            for _ in range(GREEDY):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            return ref, seq[len(ids):]
        out = model(torch.tensor([ids[:dynamic_from]]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in ids[dynamic_from:]:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
        greedy = []
        for _ in range(GREEDY):
            greedy.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[greedy[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        return torch.cat(rows).numpy(), greedy


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    preset, changes, needs_tf5 = CASES[case]
    if needs_tf5 and not TF5:
        pytest.skip(f"transformers {transformers.__version__} reads this config as 4.x did")
    model_dir, cfg = make_model(tmp_path, preset, changes)
    ids = prompt_ids(PROMPT)
    out = tmp_path / "logits.f32"
    greedy = run(BIN / "kdn_forward", model_dir, ",".join(map(str, ids)), out, GREEDY)
    kdn_tokens = [int(t) for t in greedy.strip().split(",")]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    rope = changes.get("rope_scaling") or changes.get("rope_parameters") or {}
    dynamic = rope.get("rope_type", rope.get("type")) == "dynamic"
    ref, hf_tokens = hf_logits_and_greedy(model, ids, cfg["max_position_embeddings"] if dynamic else None)
    kdn_logits = np.fromfile(out, dtype=np.float32).reshape(len(ids), model.config.vocab_size)
    err = np.abs(kdn_logits - ref).max() / np.abs(ref).max()
    print(f"\n{case}: max |kdn - hf| / max |hf| = {err:.2e} (transformers {transformers.__version__})")
    assert err < 1e-4, f"relative logit error {err:.2e}"
    assert kdn_tokens == hf_tokens


def test_the_cases_differ_from_plain_rope_and_full_attention(tmp_path):
    """The cases above test something: each changes the logits."""
    plain, _ = make_model(tmp_path / "a", "tiny", {"rope_scaling": None})
    ids = prompt_ids(PROMPT)
    run(BIN / "kdn_forward", plain, ",".join(map(str, ids)), tmp_path / "plain.f32", 1)
    base = np.fromfile(tmp_path / "plain.f32", dtype=np.float32)
    for case in ("llama-linear", "llama-dynamic", "llama-yarn"):
        d, _ = make_model(tmp_path / case, "tiny", CASES[case][1])
        run(BIN / "kdn_forward", d, ",".join(map(str, ids)), tmp_path / f"{case}.f32", 1)
        other = np.fromfile(tmp_path / f"{case}.f32", dtype=np.float32)
        assert np.abs(other - base).max() > 1e-3 * np.abs(base).max(), case
