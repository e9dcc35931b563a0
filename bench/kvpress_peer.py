#!/usr/bin/env python3
"""The peer of `kdn-bench prune-fidelity`: NVIDIA's kvpress (0.5.5) on the
same model (SmolLM2's GGUF, dequantized to f32 for transformers), the same
documents and the same question-and-answer tokens as kdn's rows.

kdn-bench writes the input (--in) and reads the output (--out); it is not
meant to be run by hand, but can be (the replays alone need no kvpress:
any transformers from 4.44 on; tests/parity/test_prune_parity.py runs them
with the test references'):

  .venv-kvpress/bin/python bench/kvpress_peer.py --in samples.json --out peer.json

Input: {"gguf", "work" (a folder for the transformers model), "threads",
"keeps", "sinks", "presses", "samples": [{"doc": ids, "qa": ids}],
"scores_sample" and "kvzip_scores_sample" (a sample whose
ExpectedAttentionPress, KVzipPress scores are written, -1 for none; without
kvpress, KVzip's are computed from transformers' attention weights),
"kvzip_chunk", "kvzip_prompts" ({"first", "next", "suffix"}: token ids), "replays": [{"sample", "kept": [layer][kv_head][kept]}]}.

For each sample, the document is prefilled under a press (which prunes the
KV as each layer finishes, as kvpress does), then the question and answer
tokens are run over the pruned KV at their true positions (kvpress's rule:
position_ids past the document, the causal mask over the KV held); per
position, KL(full || pruned) of the next-token distribution in float64 and
whether the argmaxes agree, full being the same model over the whole KV.
Replays prune the document's KV to the tokens kdn kept, per layer and KV
head, and write the question's logits (float32, [qa][vocab]) for kdn-bench
to compare with its own: the same pruned KV through transformers. Press
names: expected_attention, knorm, keydiff, streaming_llm, snapkv (its window
is the document's own last tokens: no question), kvzip.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DynamicCache, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent


def make_press(name, keep, sinks):
    from kvpress import (ExpectedAttentionPress, KeyDiffPress, KnormPress, KVzipPress,
                         SnapKVPress, StreamingLLMPress)
    ratio = 1.0 - keep
    if name == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=ratio, n_sink=sinks)
    if name == "knorm":
        return KnormPress(compression_ratio=ratio)
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=ratio)
    if name == "streaming_llm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=sinks)
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio)
    if name == "kvzip":
        return KVzipPress(compression_ratio=ratio, n_sink=sinks)
    raise SystemExit("kvpress_peer: unknown press %r" % name)


def load_model(gguf_path, work, job_needs_tokenizer):
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    sys.path.insert(0, str(REPO / "tests" / "parity"))
    import gguf
    from gguf_tokenizer import write_tokenizer
    from test_gguf import hf_folder

    folder = Path(work) / "smollm2-hf"
    if not (folder / "model.safetensors").exists():
        hf_folder(gguf.GGUFReader(str(gguf_path)), folder)
    if job_needs_tokenizer and not (folder / "tokenizer.json").exists():
        # KVzip tokenizes its own "repeat the context" prompt; SmolLM2's
        # vocabulary is GPT-2's byte-level BPE.
        write_tokenizer("gpt-2", gguf_path, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the llama config's default
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    # transformers 5 names the argument dtype, 4.x torch_dtype; sdpa where
    # torch has it.
    dtype = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        return LlamaForCausalLM.from_pretrained(folder, **{dtype: torch.float32},
                                                attn_implementation="sdpa").eval()
    except ImportError:
        return LlamaForCausalLM.from_pretrained(folder, **{dtype: torch.float32},
                                                attn_implementation="eager").eval()


def qa_logits(model, cache, doc_len, qa):
    ids = torch.tensor([qa])
    pos = torch.arange(doc_len, doc_len + len(qa)).unsqueeze(0)
    return model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0].double()


def compare(full, pruned):
    lp, lq = torch.log_softmax(full, -1), torch.log_softmax(pruned, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (full.argmax(-1) == pruned.argmax(-1)).double()
    return float(kl.mean()), float(top1.mean())


def score_recorder(sinks):
    """An ExpectedAttentionPress that keeps the scores it computes, by layer."""
    from kvpress import ExpectedAttentionPress

    class ScoreRecorder(ExpectedAttentionPress):
        def __init__(self):
            super().__init__(compression_ratio=0.5, n_sink=sinks)
            self.scores = {}

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            s = super().score(module, hidden_states, keys, values, attentions, kwargs)
            self.scores[module.layer_idx] = s[0].float().numpy().copy()
            return s

    return ScoreRecorder()


def kvzip_recorder(sinks, chunk):
    """A KVzipPress that keeps its scores (before it raises the sinks' to
    the top) and prunes nothing."""
    from kvpress import KVzipPress

    class KvzipRecorder(KVzipPress):
        def compress_post(self, model):
            self.saved = self.score_val.clone()

    return KvzipRecorder(compression_ratio=0.5, n_sink=sinks, chunk_size=chunk)


def kvzip_reference(model, doc, prompts, chunk, sinks, overlap=8):
    """KVzip's scores from transformers' own attention weights, without
    kvpress: for each part of the document, the repeat pass (prompt, the
    previous part's last `overlap` tokens after the first, the request's
    end, the part) runs over the document's KV with output_attentions;
    each row's weights, restricted to the sinks, the part and the pass's
    own keys and normalized again (the softmax over those keys alone), are
    maxed over rows and each KV head's query heads."""
    cfg = model.config
    n, kv_heads = len(doc), cfg.num_key_value_heads
    group = cfg.num_attention_heads // kv_heads
    scores = np.zeros((cfg.num_hidden_layers, kv_heads, n))
    for first in range(0, n, chunk):
        last = min(n, first + chunk)
        ids = list(prompts["first"]) if first == 0 else (
            list(prompts["next"]) + list(doc[max(0, first - overlap):first]))
        ids += list(prompts["suffix"]) + list(doc[first:last])
        cache = DynamicCache()
        model(input_ids=torch.tensor([doc]), past_key_values=cache)
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, output_attentions=True)
        sink = min(sinks, first)
        cols = list(range(sink)) + list(range(first, last)) + list(range(n, n + len(ids)))
        for layer, a in enumerate(out.attentions):  # [1][heads][rows][n + rows]
            w = a[0][:, :, cols].double()
            w = w / w.sum(-1, keepdim=True)
            part = w[:, :, sink:sink + last - first].reshape(kv_heads, group * len(ids), -1)
            scores[layer, :, first:last] = part.amax(dim=1).numpy()
    return scores


def gather_kept(cache, kept):
    """Prunes each layer's cached KV to kept[layer][kv_head] (lists of
    token indices): transformers 5's cache layers, or 4.x's key and value
    lists (the test references' transformers 4.44)."""
    def gather(t, l):
        idx = torch.tensor(kept[l]).unsqueeze(0).unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])
        return t.gather(2, idx).contiguous()
    if hasattr(cache, "layers"):
        for l, layer in enumerate(cache.layers):
            layer.keys, layer.values = gather(layer.keys, l), gather(layer.values, l)
    else:
        for l in range(len(cache.key_cache)):
            cache.key_cache[l] = gather(cache.key_cache[l], l)
            cache.value_cache[l] = gather(cache.value_cache[l], l)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    job = json.loads(Path(args.inp).read_text())
    torch.set_num_threads(job.get("threads") or torch.get_num_threads())
    work = Path(job["work"])
    work.mkdir(parents=True, exist_ok=True)
    # KVzip tokenizes a prompt of its own.
    model = load_model(job["gguf"], work, "kvzip" in job["presses"])
    samples, sinks = job["samples"], job["sinks"]
    peer = "transformers %s, torch %s, f32, %s, %d threads" % (
        transformers.__version__, torch.__version__, model.config._attn_implementation,
        torch.get_num_threads())
    # Without kvpress (the test references' venv) only the replays run.
    have_kvpress = importlib.util.find_spec("kvpress") is not None
    if have_kvpress:
        peer = "kvpress %s, %s" % (importlib.metadata.version("kvpress"), peer)
    elif job["presses"]:
        raise SystemExit("kvpress_peer: presses asked for, and this Python has no kvpress "
                         "(scripts/kvpress-env.sh)")
    out = {"peer": peer, "rows": [], "replays": []}

    with torch.no_grad():
        full = []
        for s in samples:
            cache = DynamicCache()
            model(input_ids=torch.tensor([s["doc"]]), past_key_values=cache)
            full.append(qa_logits(model, cache, len(s["doc"]), s["qa"]))
        print("kvpress_peer: full KV for %d samples" % len(samples), file=sys.stderr, flush=True)

        if have_kvpress and job.get("scores_sample", -1) >= 0:
            s = samples[job["scores_sample"]]
            rec = score_recorder(sinks)
            with rec(model):
                model(input_ids=torch.tensor([s["doc"]]), past_key_values=DynamicCache())
            scores = np.stack([rec.scores[l] for l in sorted(rec.scores)]).astype(np.float32)
            path = work / "kvpress_ea_scores.f32"
            scores.tofile(path)
            out["expected_attention_scores"] = {"file": str(path), "shape": list(scores.shape),
                                                "by": "ExpectedAttentionPress"}

        if job.get("kvzip_scores_sample", -1) >= 0:
            s = samples[job["kvzip_scores_sample"]]
            if have_kvpress:
                rec = kvzip_recorder(sinks, job["kvzip_chunk"])
                with rec(model):
                    model(input_ids=torch.tensor([s["doc"]]), past_key_values=DynamicCache())
                scores = rec.saved[:, 0].float().numpy()  # [layer][kv_head][token]
            else:
                scores = kvzip_reference(model, s["doc"], job["kvzip_prompts"],
                                         job["kvzip_chunk"], sinks)
            scores = scores.astype(np.float32)
            path = work / "kvpress_kvzip_scores.f32"
            scores.tofile(path)
            out["kvzip_scores"] = {"file": str(path), "shape": list(scores.shape),
                                   "by": "KVzipPress" if have_kvpress
                                   else "transformers' attention weights"}

        for r in job.get("replays", []):
            s = samples[r["sample"]]
            cache = DynamicCache()
            model(input_ids=torch.tensor([s["doc"]]), past_key_values=cache)
            gather_kept(cache, r["kept"])
            logits = qa_logits(model, cache, len(s["doc"]), s["qa"]).float().numpy()
            path = work / ("kvpress_replay_%d.f32" % len(out["replays"]))
            logits.tofile(path)
            out["replays"].append({"file": str(path), "rows": logits.shape[0],
                                   "vocab": logits.shape[1]})

        for name in job["presses"]:
            for keep in job["keeps"]:
                row = {"method": "kvpress:" + name, "keep": keep, "kl": [], "top1": [],
                       "stored_tokens": [], "seconds": 0.0}
                for i, s in enumerate(samples):
                    press = make_press(name, keep, sinks)
                    cache = DynamicCache()
                    t0 = time.perf_counter()
                    with press(model):
                        model(input_ids=torch.tensor([s["doc"]]), past_key_values=cache)
                    row["seconds"] += time.perf_counter() - t0
                    # Tokens stored per KV head, the mean over layers. KVzip
                    # keeps the whole KV and masks the keys it drops, a
                    # count that varies by layer and head.
                    stored = []
                    for layer, block in zip(cache.layers, model.model.layers):
                        n = layer.keys.shape[2]
                        masked = getattr(block.self_attn, "masked_key_indices", None)
                        if masked is not None:
                            n -= len(masked[2]) / layer.keys.shape[1]
                        stored.append(n)
                    row["stored_tokens"].append(float(np.mean(stored)))
                    kl, top1 = compare(full[i], qa_logits(model, cache, len(s["doc"]), s["qa"]))
                    row["kl"].append(kl)
                    row["top1"].append(top1)
                out["rows"].append(row)
                print("kvpress_peer: %s keep %.3f: KL %.4f" % (name, keep, np.mean(row["kl"])),
                      file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
