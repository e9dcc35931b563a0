"""Trains the kdn-qa model on the corpus of corpus.py (PyTorch, CPU or CUDA).

  python3 train.py --out /tmp/kdn-qa-run --steps 1500 --seed 0 --threads 2
  python3 train.py --out /tmp/kdn-qa-run --steps 1500 --seed 0 --threads 2 --resume

  (train.sh --device cuda holds the GPU recipe's flags)

The batch of step s is drawn from random.Random("seed-s"), so a run is
deterministic given --seed and --threads (on one kind of machine) and a resumed
run sees the same data as an uninterrupted one; --workers processes make the
batches ahead (in step order, the same batches as without them). On CUDA the
forward and backward run under bf16 autocast (weights and optimizer in fp32).
A checkpoint (model, optimizer, step) is written to OUT/ckpt.pt every
--ckpt-every steps and at the end; the final model is exported to OUT/model
(or --export DIR) by export.py.
"""

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import export  # noqa: E402
from model import Config, LlamaForCausalLM  # noqa: E402


def Encode(text):
    return [corpus.BOS] + list(text.encode())


def TrainBatch(seed, step, n_examples, n_micro, max_questions, max_docs, two_hop_share=0.5,
               copy_share=0.0, coref_share=0.0, pad_to=1, answer_weight=5.0):
    """Microbatches (ids, targets, weights) for one step, grouped by length;
    answer bytes weigh answer_weight, the others 1.

    Each microbatch's length is rounded up to a multiple of pad_to (padding
    has weight 0), which keeps the number of distinct shapes small on a GPU.
    """
    rng = random.Random("{}-{}".format(seed, step))
    seqs = []
    for _ in range(n_examples):
        if rng.random() < copy_share:
            text, spans = corpus.MakeCopyText(rng, max_docs)
        else:
            text, spans = corpus.MakeTrainText(rng, max_questions, max_docs, two_hop_share,
                                               coref_share)
        ids = Encode(text) + [corpus.EOS]
        w = [1.0] * (len(ids) - 1)  # weight of predicting ids[i + 1]
        for a, b in spans:
            for j in range(a, b):  # byte j is token j + 1, predicted at j
                w[j] = answer_weight
        seqs.append((ids, w))
    seqs.sort(key=lambda s: len(s[0]))
    per = math.ceil(n_examples / n_micro)
    out = []
    for i in range(0, n_examples, per):
        group = seqs[i:i + per]
        t = max(len(ids) for ids, _ in group) - 1
        t = -(-t // pad_to) * pad_to
        # numpy, not torch: batches made by --workers cross processes as
        # plain pickles (torch tensors would each pass a file descriptor).
        x = np.zeros((len(group), t), dtype=np.int64)
        y = np.zeros((len(group), t), dtype=np.int64)
        wt = np.zeros((len(group), t), dtype=np.float32)
        for r, (ids, w) in enumerate(group):
            n = len(ids) - 1
            x[r, :n] = ids[:-1]
            y[r, :n] = ids[1:]
            wt[r, :n] = w
        out.append((x, y, wt))
    return out


def StepSchedule(step, args):
    """(max_docs, two_hop_share, copy_share) of a step: the curriculum."""
    max_docs = args.short_docs if step < args.short_frac * args.steps else 8
    two_hop = 0.0 if step < args.single_frac * args.steps else 0.5
    copy = 0.0
    if step < args.copy_frac * args.steps:
        copy = args.copy_share * (1 - step / (args.copy_frac * args.steps))
    return max_docs, two_hop, copy


def StepBatch(args, step):
    """The microbatches of one step (a function of args and step only)."""
    max_docs, two_hop, copy = StepSchedule(step, args)
    return TrainBatch(args.seed, step, args.examples, args.micro, args.max_questions,
                      max_docs, two_hop, copy, args.coref_share, args.pad_to,
                      args.answer_weight)


def Batches(args, first_step):
    """Yields the batches of steps first_step.. in order, made by --workers
    processes ahead of the training loop (or inline when --workers is 0)."""
    steps = range(first_step, args.steps)
    if args.workers <= 0:
        for s in steps:
            yield StepBatch(args, s)
        return
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(args.workers)
    try:
        yield from pool.imap(functools.partial(StepBatch, args), steps, chunksize=4)
    finally:
        pool.terminate()
        pool.join()


def ProbeSet(n):
    """Held-out examples for the in-training probe (not eval.jsonl's seed),
    the families in turn."""
    return corpus.EvalSet(987654321, n)


@torch.no_grad()
def TeacherForcedExact(model, examples, device):
    """Fraction per family whose " answer\\n" is argmax at every byte.

    This equals greedy-decoding exact match on the answer and its newline.
    """
    model.eval()
    hits = {}
    for ex in examples:
        prompt = Encode(corpus.Prompt(ex["documents"], ex["question"]))
        cont = list((" " + ex["answer"] + "\n").encode())
        ids = torch.tensor([prompt + cont], device=device)
        logits = model(ids[:, :-1])[0, len(prompt) - 1:]
        ok = bool((logits.argmax(-1).cpu() == torch.tensor(cont)).all())
        h = hits.setdefault(ex["family"], [0, 0])
        h[0] += ok
        h[1] += 1
    model.train()
    return {f: a / max(b, 1) for f, (a, b) in hits.items()}


def LrAt(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", default=None, help="export folder (default OUT/model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--examples", type=int, default=16, help="examples per step")
    ap.add_argument("--micro", type=int, default=4, help="length-grouped microbatches per step")
    ap.add_argument("--max-questions", type=int, default=6)
    ap.add_argument("--short-frac", type=float, default=0.0,
                    help="fraction of steps (from the start) using 2..--short-docs documents")
    ap.add_argument("--short-docs", type=int, default=4,
                    help="most documents per example during the --short-frac steps")
    ap.add_argument("--single-frac", type=float, default=0.0,
                    help="fraction of steps (from the start) with single-hop questions only")
    ap.add_argument("--copy-frac", type=float, default=0.0,
                    help="fraction of steps (from the start) in which examples may be "
                         "copy sequences (corpus.MakeCopyText), their share falling "
                         "linearly from --copy-share to 0")
    ap.add_argument("--copy-share", type=float, default=0.5)
    ap.add_argument("--coref-share", type=float, default=0.0,
                    help="share of question examples whose world has coref people "
                         "(corpus.py: a name, then a pronoun document)")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes making batches ahead of training (0: inline)")
    ap.add_argument("--pad-to", type=int, default=1,
                    help="round microbatch lengths up to a multiple of this")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--answer-weight", type=float, default=5.0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--probe-every", type=int, default=250)
    ap.add_argument("--probe-size", type=int, default=64)
    ap.add_argument("--log-seconds", type=float, default=30)
    ap.add_argument("--stop-step", type=int, default=0,
                    help="stop (checkpoint and export) after this step, under the learning-rate "
                         "schedule of --steps; 0: at --steps. Replays a run that --max-minutes "
                         "cut short.")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="stop (checkpoint and export) after this much training time; "
                         "0: no limit. A run cut short is not the deterministic one.")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    cfg = Config(hidden_size=args.hidden, intermediate_size=args.ffn,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads)
    model = LlamaForCausalLM(cfg).to(args.device)
    on_cuda = str(args.device).startswith("cuda")
    autocast = (functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if on_cuda
                else contextlib.nullcontext)
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        # cuDNN's fused attention builds a plan for each new sequence length
        # (hundreds of ms); batches here have dozens of lengths. FlashAttention
        # needs no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    step, elapsed, tokens = 0, 0.0, 0
    history = []
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=args.device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, tokens = ck["step"], ck["elapsed"], ck["tokens"]
        history = ck.get("history", [])
        print("resumed at step {} ({:.0f} s, {} tokens)".format(step, elapsed, tokens), flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print("model: {} layers, hidden {}, ffn {}, heads {}/{}, {:.2f}M parameters; "
          "device {}, threads {}".format(args.layers, args.hidden, args.ffn, args.heads,
                                          args.kv_heads, n_params / 1e6, args.device,
                                          args.threads), flush=True)
    probe = ProbeSet(args.probe_size)

    def Save():
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed, "tokens": tokens, "history": history,
                    "config": cfg.ToHf("float32"), "args": vars(args)}, tmp)
        os.replace(tmp, ckpt_path)

    model.train()
    t_last = time.time()
    win_loss, win_aloss, win_n, win_tok, win_t0 = 0.0, 0.0, 0, 0, time.time()
    batches = Batches(args, step)
    while step < args.steps:
        t0 = time.time()
        micro = [tuple(torch.from_numpy(a) for a in m) for m in next(batches)]
        total_w = sum(float(w.sum()) for _, _, w in micro)
        for g in opt.param_groups:
            g["lr"] = LrAt(step, args)
        opt.zero_grad(set_to_none=True)
        # Losses stay on the device until a log line needs them: no
        # synchronization per microbatch.
        step_loss = torch.zeros((), device=args.device)
        a_loss = torch.zeros((), device=args.device)
        a_n = 0.0
        for x, y, w in micro:
            a_n += float((w > 1.0).sum())
            n_tok = int((w > 0).sum())
            tokens += n_tok
            win_tok += n_tok
            x = x.to(args.device, non_blocking=True)
            y = y.to(args.device, non_blocking=True)
            w = w.to(args.device, non_blocking=True)
            with autocast():
                logits = model(x)
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                  reduction="none").view_as(w)
            loss = (nll * w).sum() / total_w
            loss.backward()
            step_loss += loss.detach()
            a_loss += (nll.detach() * (w > 1.0)).sum()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        win_loss = win_loss + step_loss
        win_aloss = win_aloss + a_loss / max(a_n, 1)
        win_n += 1
        elapsed += time.time() - t0
        now = time.time()
        if now - t_last >= args.log_seconds or step == args.steps:
            win_loss, win_aloss = float(win_loss), float(win_aloss)
            rate = win_tok / (now - win_t0)
            eta = (args.steps - step) * elapsed / max(step, 1)
            print("step {}/{} loss {:.4f} answer-loss {:.4f} lr {:.2e} tok/s {:.0f} "
                  "elapsed {:.0f}s eta {:.0f}s".format(
                      step, args.steps, win_loss / win_n, win_aloss / win_n,
                      LrAt(step - 1, args), rate, elapsed, eta), flush=True)
            history.append({"step": step, "loss": win_loss / win_n,
                            "answer_loss": win_aloss / win_n, "elapsed": elapsed,
                            "tokens": tokens})
            win_loss, win_aloss, win_n, win_tok, win_t0 = 0.0, 0.0, 0, 0, now
            t_last = now
        if step % args.probe_every == 0 or step == args.steps:
            t0 = time.time()
            acc = TeacherForcedExact(model, probe, args.device)
            print("probe step {}: {} ({:.0f}s)".format(
                step, " ".join("{} {:.3f}".format(f, acc[f]) for f in corpus.FAMILIES if f in acc),
                time.time() - t0), flush=True)
            history.append({"step": step, "probe": acc})
        cut = ((args.max_minutes and elapsed > 60 * args.max_minutes) or
               (args.stop_step and step >= args.stop_step))
        if step % args.ckpt_every == 0 or step == args.steps or cut:
            Save()
        if cut:
            print("stopped at step {} ({})".format(
                step, "--stop-step" if args.stop_step and step >= args.stop_step
                else "time limit reached"), flush=True)
            break
    batches.close()  # stops the workers now, not at interpreter exit (where it can hang)
    out = args.export or os.path.join(args.out, "model")
    export.Export(model, out)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"steps": step, "tokens": tokens, "train_seconds": elapsed,
                   "final_loss": next((h["loss"] for h in reversed(history) if "loss" in h),
                                      None),
                   "history": history, "args": vars(args)}, f, indent=1)
    print("exported {}; {} steps, {} tokens, {:.0f} s".format(out, step, tokens, elapsed),
          flush=True)


if __name__ == "__main__":
    main()
