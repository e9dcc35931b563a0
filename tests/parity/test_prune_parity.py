"""kdn's pruned KV against transformers over the same tokens' KV.

kdn-bench prune-fidelity prunes a document of real prose (a Debian licence
text) on SmolLM2 with Expected Attention, per KV head, at keep 0.25, and
runs a question and its answer over the pruned KV: each kept key stays
rotated for the position it was computed at, the question sits past the
whole document (the engine's next position, not its KV length), attention
runs over the KV held. bench/kvpress_peer.py, here on the test references'
transformers (no kvpress), computes the document's KV, keeps exactly the
tokens kdn kept in each layer and head, and runs the same tokens with
transformers' own rule (position_ids past the document, the causal mask
over the cache it holds). Both must give the same next-token distributions;
and pruning must have changed them (else the comparison proves nothing).
kdn runs the GGUF's weights widened to f32 (--weights-dtype f32), as
transformers holds them: on the weights as stored, its products take
8-bit activations at every batch size (batch invariance,
docs/engine.md), which agree with transformers' f32 less closely.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from gguf_micro import smollm2_path

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))
REPO = Path(__file__).resolve().parents[2]


def test_pruned_kv_answers_as_transformers_over_the_same_kept_tokens(tmp_path):
    out = tmp_path / "prune.json"
    cmd = [BIN / "kdn-bench", "prune-fidelity", "--model", smollm2_path(), "--documents", "1",
           "--questions", "1", "--doc-tokens", "192", "--answer-tokens", "24", "--keep", "0.25",
           "--methods", "expected_attention", "--granularity", "head", "--threads", "1",
           "--weights-dtype", "f32", "--kvpress-python", sys.executable, "--kvpress-script",
           REPO / "bench" / "kvpress_peer.py", "--kvpress-presses", "none",
           "--work-dir", tmp_path / "work", "--json", out]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    replay = r["checks"]["transformers_replay"]
    assert replay["keep"] == 0.25
    assert replay["kl_whole_kv"] < 1e-6, replay
    assert replay["kl_pruned_kv"] < 1e-6, replay
    assert replay["top1_pruned_kv"] == 1.0, replay
    row = next(x for x in r["rows"] if x["method"] == "kdn:expected_attention/head")
    assert row["stored_tokens"] < 0.26 * next(x for x in r["rows"]
                                              if x["method"] == "full")["stored_tokens"]
    assert row["kl"] > 1e-4, row


def test_kvzip_scores_are_transformers_attention_weights_of_the_repeat_pass(tmp_path):
    """KVzip's scores (kdn/prune/kvzip.h) of a document repeated in parts of
    64 tokens, against the same quantities taken from transformers' own
    attention weights (bench/kvpress_peer.py's kvzip_reference: eager
    attention, output_attentions); then kdn keeps the best of all layers and
    heads together (granularity global), each head as many tokens as its
    scores earn, which leaves holes in the shorter heads' slots."""
    out = tmp_path / "kvzip.json"
    cmd = [BIN / "kdn-bench", "prune-fidelity", "--model", smollm2_path(), "--documents", "1",
           "--questions", "1", "--doc-tokens", "192", "--answer-tokens", "8", "--keep", "0.25",
           "--methods", "kvzip", "--granularity", "global", "--kvzip-chunk", "64",
           "--no-kvzip-profiled",
           "--threads", "1", "--weights-dtype", "f32", "--kvpress-python", sys.executable,
           "--kvpress-script",
           REPO / "bench" / "kvpress_peer.py", "--kvpress-presses", "none",
           "--work-dir", tmp_path / "work", "--json", out]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    check = r["checks"]["kvzip_scores"]
    assert check["values"] > 30 * 3 * 192, check
    assert check["max_abs_diff"] < 1e-4, check
    row = next(x for x in r["rows"] if x["method"] == "kdn:kvzip/global")
    full = next(x for x in r["rows"] if x["method"] == "full")["stored_tokens"]
    assert abs(row["stored_tokens"] - 0.25 * full) < 1.0, row
    assert row["kl"] > 1e-4, row
