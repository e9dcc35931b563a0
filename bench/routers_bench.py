#!/usr/bin/env python3
"""kdn through one router and through two over the same workers
(docs/serving.md, "More than one router"): a shared-prefix workload, its hit
rate and first tokens either way.

Each deployment is `kdn-launch up --store --routers N` on the GGUF (N = 1,
then 2; never both at once). The workload: USERS requests, CONCURRENCY at a
time, each a chat whose system message is one of PROMPTS long system prompts
(PROMPT words each; picked with Zipf-like weights, so a few are popular) and
a question of its own; with two routers the requests alternate between them.
Rows: routers, requests, errors, hit_rate (the prompt tokens kdn reported
cached over all prompt tokens), ttft_p50_ms, ttft_p95_ms, output_tok_s,
wall_s; then a row of two routers' figures over one router's
(hit_rate_ratio, ttft_p50_ratio: one router's TTFT over two's, > 1 where two
do better). Texts are generated from a fixed seed (bench/serving_peers.py).

    bench/routers_bench.py [--out FILE] [--work DIR] [--kdn-args "FLAGS"] [--quick]

Run it with the tests' virtual environment (httpx): .venv-ref/bin/python.
"""

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_peers import GGUF, REPO, chat, limited, log, question, summarize, text  # noqa: E402

FULL = {"prompts": 6, "prompt": 1200, "users": 48, "concurrency": 8}
QUICK = {"prompts": 2, "prompt": 100, "users": 6, "concurrency": 2}


class Router:
    """What serving_peers.chat needs of a server: its URL, no extra fields."""

    def __init__(self, url):
        self.url = url

    def extra(self, documents):
        return {}, ""


def deploy(args, routers):
    run_dir = Path(args.work) / ("kdn-run-%d" % routers)
    cmd = [str(REPO / "launch/kdn-launch"), "up", "--model", str(args.model), "--store",
           "--run-dir", str(run_dir), "--port", str(args.port), "--detach",
           "--routers", str(routers)] + shlex.split(args.kdn_args)
    log("kdn: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    info = json.loads((run_dir / "deployment.json").read_text())
    return run_dir, info["urls"], " ".join(cmd[1:])


async def workload(urls, p):
    rng = random.Random(53)
    systems = [text(rng, p["prompt"]) for _ in range(p["prompts"])]
    weights = [1.0 / (i + 1) for i in range(p["prompts"])]
    picks = rng.choices(range(p["prompts"]), weights=weights, k=p["users"])
    routers = [Router(u) for u in urls]
    timeout = httpx.Timeout(900, connect=10)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = (await client.get(urls[0] + "/v1/models")).json()["data"][0]["id"]
        for r in routers:  # a warm-up through each
            warm = await chat(client, r, model, [{"role": "user", "content": "Hello there."}])
            if warm.error:
                raise RuntimeError("the warm-up through %s failed: %s" % (r.url, warm.error))
        jobs = [lambda i=i, s=s: chat(client, routers[i % len(routers)], model,
                                      [{"role": "system", "content": systems[s]},
                                       {"role": "user", "content": question(rng)}])
                for i, s in enumerate(picks)]
        t0 = time.perf_counter()
        results = await limited(p["concurrency"], jobs)
        return results, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kdn-args", default="", metavar="ARGS",
                    help="more kdn-launch up flags (one string, split as a shell would)")
    ap.add_argument("--model", default=str(GGUF))
    ap.add_argument("--port", type=int, default=8751)
    ap.add_argument("--quick", action="store_true", help="a small workload: checks the bench runs")
    ap.add_argument("--out", help="also write the rows here (JSON lines)")
    ap.add_argument("--work", default=str(REPO / ".routers-bench"),
                    help="scratch: the deployments' run folders")
    args = ap.parse_args()
    if not Path(args.model).exists():
        ap.error("no model at %s (scripts/fetch-smollm2.sh fetches it)" % args.model)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    p = QUICK if args.quick else FULL
    header = {"bench": "routers", "date": datetime.now(timezone.utc).isoformat(),
              "cores": os.cpu_count(), "model": str(args.model), "params": p,
              "quick": args.quick, "commands": {}}
    rows = []
    for n in (1, 2):
        run_dir, urls, command = deploy(args, n)
        header["commands"][str(n)] = command
        try:
            results, wall = asyncio.run(workload(urls, p))
        finally:
            subprocess.run([str(REPO / "launch/kdn-launch"), "down", "--run-dir", str(run_dir)],
                           stdout=sys.stderr, stderr=sys.stderr)
        row = summarize("shared-prefix", "kdn", p["concurrency"], results, wall)
        ok = [r for r in results if r.error is None and r.prompt_tokens]
        row["routers"] = n
        row["hit_rate"] = round(sum(r.cached_tokens or 0 for r in ok) /
                                max(1, sum(r.prompt_tokens for r in ok)), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    one, two = rows
    ratio = {"workload": "shared-prefix", "ratio": "two routers to one",
             "hit_rate_ratio": round(two["hit_rate"] / one["hit_rate"], 3) if one["hit_rate"] else None,
             "ttft_p50_ratio": round(one["ttft_p50_ms"] / two["ttft_p50_ms"], 3)
             if one["ttft_p50_ms"] and two["ttft_p50_ms"] else None}
    print(json.dumps(ratio), flush=True)
    rows.append(ratio)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(header) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(header), flush=True)


if __name__ == "__main__":
    main()
