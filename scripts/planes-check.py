#!/usr/bin/env python3
"""scripts/gpu-check.sh's step `planes`: SmolLM2 served on one GPU with
`--kv-transport cuda_ipc` (the decode worker exports its KV pool, the prefill
worker writes each layer slice into it), with `nccl` (the prefill worker sends
each slice over an NCCL link into the decode worker's pool: two ranks on one
GPU, which needs NCCL 2.30 or newer and NCCL_MULTI_RANK_GPU_ENABLE=1, set
here), then with `auto` (the host path), in one run. For each: the greedy chat turns against kdn-generate's
(smollm2_want.json, written by the step before), the first-token time of
prompts of about 4K tokens pushed from the prefill worker, and what the
decode worker's /metrics says moved the KV and how much it copied at Start.

    scripts/planes-check.py BIN_DIR REPO SMOLLM2_GGUF OUT_DIR [DEVICE]

DEVICE is cuda by default; `cpu`, with KDN_DEVICE_OPS=host in the
environment (the host backend standing in for a device), runs the same
check on a CPU machine: how the script itself is tested.

Writes OUT_DIR/planes.json; exits 1 unless the cuda_ipc deployment answers as
kdn-generate does, its KV came by cuda_ipc alone, the prefill worker read
the slices where they lie in its pool (kdn_kv_slices_sourced_total) and
nothing was copied at Start. The nccl deployment is held to the same and
reported as `nccl_ok`, without failing the step (the NCCL on the machine may
not take two ranks on one GPU). Standard library only.
"""

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TTFT_PROMPTS = 3
PROMPT_WORDS = 4000  # 4K SmolLM2 tokens: one token per word of these (3,000 gave 3,005)


def up(bin_dir, repo, model, run, transport, log, device):
    env = dict(os.environ, KDN_BIN_DIR=str(bin_dir), NCCL_MULTI_RANK_GPU_ENABLE="1")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, str(repo / "launch" / "kdn-launch"), "up", "--detach",
                            "--port", "0", "--run-dir", str(run), "--model", str(model), "--store",
                            "--device", device, "--threads", "4", "--ready-timeout", "120",
                            "--kv-transport", transport], stdout=f, stderr=subprocess.STDOUT,
                           env=env, timeout=300)
    text = Path(log).read_text()
    if r.returncode != 0:
        raise RuntimeError("kdn-launch up --kv-transport %s failed:\n%s" % (transport, text[-3000:]))
    return text.strip().splitlines()[-1].split()[-1]


def down(bin_dir, repo, run):
    env = dict(os.environ, KDN_BIN_DIR=str(bin_dir))
    subprocess.run([sys.executable, str(repo / "launch" / "kdn-launch"), "down", "--run-dir",
                    str(run)], env=env, timeout=120, stdout=subprocess.DEVNULL)


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def chat_turns(url, turns):
    equal = 0
    for t in turns:
        with post(url, "/v1/chat/completions", {"messages": t["messages"], "max_tokens": 24,
                                                "temperature": 0,
                                                "disaggregation": "always"}) as r:
            got = json.load(r)["choices"][0]["message"]["content"]
        equal += got == t["want"]
        print("  %s: %r (kdn-generate %r)" % ("equal" if got == t["want"] else "DIFFERENT", got,
                                             t["want"]))
    return equal


def ttft_ms(url, seed):
    """First-token time of a fresh ~4K-token prompt pushed from the prefill
    worker, streamed; and its prompt tokens."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(["river", "stone", "light", "north", "quiet", "paper", "orange",
                                 "window", "garden", "silver", "market", "thunder"])
                     for _ in range(PROMPT_WORDS))
    body = {"prompt": "%d: %s" % (seed, words), "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "disaggregation": "always"}
    t0 = time.monotonic()
    first, tokens = None, None
    with post(url, "/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.monotonic()
            if event.get("usage"):
                tokens = event["usage"].get("prompt_tokens")
    return (first - t0) * 1000.0 if first else None, tokens


def decode_metrics(url):
    """The decode worker's KV figures, and the slices prefill workers read
    where they lie in their pool."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {"planes": {}}
    for line in text.splitlines():
        if line.startswith("kdn_kv_slices_sourced_total "):
            out["slices_sourced"] = float(line.split()[-1])
        if 'role="decode"' not in line:
            continue
        m = re.match(r'kdn_worker_kv_transport_bytes_total\{.*transport="([a-z_]+)".*\} (\S+)', line)
        if m:
            out["planes"][m.group(1)] = float(m.group(2))
        m = re.match(r'kdn_worker_kv_(start_copy|landed)_bytes_total\{.*\} (\S+)', line)
        if m:
            out[m.group(1) + "_bytes"] = float(m.group(2))
    return out


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    bin_dir, repo, model, out = (Path(a).resolve() for a in sys.argv[1:5])
    device = sys.argv[5] if len(sys.argv) == 6 else "cuda"
    turns = json.loads((out / "smollm2_want.json").read_text())
    rows = []
    for transport in ("cuda_ipc", "nccl", "auto"):
        run = out / ("planes-run-" + transport)
        print("== SmolLM2 with --kv-transport %s" % transport)
        try:
            url = up(bin_dir, repo, model, run, transport, out / ("planes_up_%s.out" % transport),
                     device)
        except Exception as e:  # noqa: BLE001 - reported as the row's failure
            print("  " + str(e))
            rows.append({"transport": transport, "error": str(e)})
            continue
        try:
            equal = chat_turns(url, turns)
            ttfts = []
            for i in range(TTFT_PROMPTS):
                ms, tokens = ttft_ms(url, 1000 * (i + 1) + len(transport))
                ttfts.append(ms)
                print("  first token %.1f ms (%s prompt tokens)" % (ms or -1, tokens))
            time.sleep(1.5)  # the workers' figures reach the router with its next ping
            m = decode_metrics(url)
            print("  decode worker: %s" % json.dumps(m))
            rows.append({"transport": transport, "turns": len(turns), "equal": equal,
                         "prompt_tokens": tokens,
                         "ttft_ms_median": statistics.median(t for t in ttfts if t),
                         "ttft_ms": ttfts, "decode": m})
        finally:
            down(bin_dir, repo, run)
    by = {r["transport"]: r for r in rows}
    auto = by.get("auto", {})

    def plane_ok(plane):
        row = by.get(plane, {})
        planes = (row.get("decode") or {}).get("planes", {})
        return (row.get("equal") == len(turns) and planes.get(plane, 0) > 0
                and all(v == 0 for k, v in planes.items() if k != plane)
                and (row.get("decode") or {}).get("start_copy_bytes", 1) == 0
                and (row.get("decode") or {}).get("slices_sourced", 0) > 0)

    ok = plane_ok("cuda_ipc")
    result = {"rows": rows, "ok": ok, "nccl_ok": plane_ok("nccl")}
    for plane in ("cuda_ipc", "nccl"):
        row = by.get(plane, {})
        if row.get("ttft_ms_median") and auto.get("ttft_ms_median"):
            result[plane + "_vs_host_ttft"] = row["ttft_ms_median"] / auto["ttft_ms_median"]
    (out / "planes.json").write_text(json.dumps(result, indent=1))
    print("planes: %s (nccl: %s)" % ("ok" if ok else "FAILED",
                                     "ok" if result["nccl_ok"] else "failed"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
