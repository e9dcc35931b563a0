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

    bench/routers_bench.py [--out FILE] [--work DIR] [--kdn-args "FLAGS"] [--quick] [--no-pins]
                           [--lookups] [--only-lookups]

Then the pins (docs/serving.md, "Pinning a prefix"), unless --no-pins: two
more deployments of one router, no kdn-store, with caches smaller than the
workload (PRESSURE_ARGS: host tiers of 192 MiB, about 3 of the system
prompts' f32 KV), where the same shared-prefix chats are interleaved with as
many one-off chats over long system prompts of their own (COLD words), which
evict what they pass. First with no pins, then with the PINNED most popular
system prompts marked `cache_control` (ttl 1h). Rows: pins (0 or PINNED),
and hit_rate, ttft_p50_ms, ttft_p95_ms over the shared-prefix chats alone;
then the ratio row (pinned to unpinned: hit_rate_ratio, ttft_p50_ratio, one
without pins over one with).

With --lookups, two more deployments of one router and no kdn-store, with
their workers' KV events on (--kv-events-port): the shared-prefix workload
with the router asking the workers, then following their events
(--lookups-from-events). Rows: lookups ("worker" or "events"), then the
ratio row (ttft_p50_ratio: asking over following).

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
# The pins' runs: as many one-off chats as shared-prefix ones, over system
# prompts of `cold` words; the `pinned` most popular system prompts pinned.
PRESSURE = dict(FULL, concurrency=4, cold=2000, pinned=2)
PRESSURE_QUICK = dict(QUICK, cold=300, pinned=1)
PRESSURE_ARGS = "--host-mib 192 --decode-kv-tokens 8192"


class Router:
    """What serving_peers.chat needs of a server: its URL, no extra fields."""

    def __init__(self, url):
        self.url = url

    def extra(self, documents):
        return {}, ""


def deploy(args, routers, name=None, store=True, more=""):
    run_dir = Path(args.work) / (name or "kdn-run-%d" % routers)
    cmd = [str(REPO / "launch/kdn-launch"), "up", "--model", str(args.model),
           "--run-dir", str(run_dir), "--port", str(args.port), "--detach",
           "--routers", str(routers)] + (["--store"] if store else []) + \
        shlex.split(more) + shlex.split(args.kdn_args)
    log("kdn: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    info = json.loads((run_dir / "deployment.json").read_text())
    return run_dir, info["urls"], " ".join(cmd[1:])


def system_message(content, pinned):
    if not pinned:
        return {"role": "system", "content": content}
    return {"role": "system", "content": [{"type": "text", "text": content,
                                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}


async def workload(urls, p, pins=0):
    """The shared-prefix chats (and with p["cold"], as many one-off ones
    between them); returns the shared-prefix chats' results and the wall
    time of all. The `pins` most popular system prompts carry cache_control."""
    rng = random.Random(53)
    systems = [text(rng, p["prompt"]) for _ in range(p["prompts"])]
    weights = [1.0 / (i + 1) for i in range(p["prompts"])]
    picks = rng.choices(range(p["prompts"]), weights=weights, k=p["users"])
    cold = [text(rng, p["cold"]) for _ in range(p["users"])] if p.get("cold") else []
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
                                      [system_message(systems[s], s < pins),
                                       {"role": "user", "content": question(rng)}])
                for i, s in enumerate(picks)]
        if cold:
            shared = jobs
            jobs = []
            for i, c in enumerate(cold):
                jobs += [shared[i], lambda c=c: chat(client, routers[0], model,
                                                     [system_message(c, False),
                                                      {"role": "user", "content": question(rng)}])]
        t0 = time.perf_counter()
        results = await limited(p["concurrency"], jobs)
        wall = time.perf_counter() - t0
        return (results[0::2] if cold else results), wall


def measure(args, p, routers, name=None, store=True, more="", pins=0):
    """One deployment, its workload and its row."""
    run_dir, urls, command = deploy(args, routers, name, store, more)
    try:
        results, wall = asyncio.run(workload(urls, p, pins))
    finally:
        subprocess.run([str(REPO / "launch/kdn-launch"), "down", "--run-dir", str(run_dir)],
                       stdout=sys.stderr, stderr=sys.stderr)
    row = summarize("shared-prefix" if not p.get("cold") else "shared-prefix+cold", "kdn",
                    p["concurrency"], results, wall)
    ok = [r for r in results if r.error is None and r.prompt_tokens]
    row["routers"] = routers
    row["hit_rate"] = round(sum(r.cached_tokens or 0 for r in ok) /
                            max(1, sum(r.prompt_tokens for r in ok)), 4)
    print(json.dumps(row), flush=True)
    return row, command


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
    ap.add_argument("--no-pins", action="store_true",
                    help="leave out the two deployments that measure pinned prefixes")
    ap.add_argument("--lookups", action="store_true",
                    help="add two deployments: lookups asked of the workers, then answered by "
                         "their KV events")
    ap.add_argument("--only-lookups", action="store_true",
                    help="run the --lookups deployments alone")
    args = ap.parse_args()
    if not Path(args.model).exists():
        ap.error("no model at %s (scripts/fetch-smollm2.sh fetches it)" % args.model)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    p = QUICK if args.quick else FULL
    header = {"bench": "routers", "date": datetime.now(timezone.utc).isoformat(),
              "cores": os.cpu_count(), "model": str(args.model), "params": p,
              "quick": args.quick, "commands": {}}
    rows = []
    if args.only_lookups:
        args.lookups = True
        args.no_pins = True
    for n in (() if args.only_lookups else (1, 2)):
        row, header["commands"][str(n)] = measure(args, p, n)
        rows.append(row)
    if args.lookups:
        pair = []
        for how in ("worker", "events"):
            more = "--kv-events-port %d" % (args.port + 100)
            if how == "events":
                more += " --lookups-from-events"
            row, header["commands"]["lookups-" + how] = measure(
                args, p, 1, "kdn-run-lookups-" + how, store=False, more=more)
            row["lookups"] = how
            pair.append(row)
        ratio = {"workload": "shared-prefix", "ratio": "lookups from events to asked",
                 "hit_rate_ratio": round(pair[1]["hit_rate"] / pair[0]["hit_rate"], 3)
                 if pair[0]["hit_rate"] else None,
                 "ttft_p50_ratio": round(pair[0]["ttft_p50_ms"] / pair[1]["ttft_p50_ms"], 3)
                 if pair[0]["ttft_p50_ms"] and pair[1]["ttft_p50_ms"] else None}
        print(json.dumps(ratio), flush=True)
        rows += pair + [ratio]
    if args.only_lookups:
        return finish(args, header, rows)
    one, two = rows[:2]
    ratio = {"workload": "shared-prefix", "ratio": "two routers to one",
             "hit_rate_ratio": round(two["hit_rate"] / one["hit_rate"], 3) if one["hit_rate"] else None,
             "ttft_p50_ratio": round(one["ttft_p50_ms"] / two["ttft_p50_ms"], 3)
             if one["ttft_p50_ms"] and two["ttft_p50_ms"] else None}
    print(json.dumps(ratio), flush=True)
    rows.append(ratio)
    if not args.no_pins:
        pp = PRESSURE_QUICK if args.quick else PRESSURE
        header["pressure_params"] = pp
        pair = []
        for pins in (0, pp["pinned"]):
            row, header["commands"]["pins-%d" % pins] = measure(
                args, pp, 1, "kdn-run-pins-%d" % pins, store=False, more=PRESSURE_ARGS, pins=pins)
            row["pins"] = pins
            pair.append(row)
        rows += pair
        plain, pinned = pair
        ratio = {"workload": "shared-prefix+cold", "ratio": "pinned to unpinned",
                 "hit_rate_ratio": round(pinned["hit_rate"] / plain["hit_rate"], 3)
                 if plain["hit_rate"] else None,
                 "ttft_p50_ratio": round(plain["ttft_p50_ms"] / pinned["ttft_p50_ms"], 3)
                 if plain["ttft_p50_ms"] and pinned["ttft_p50_ms"] else None}
        print(json.dumps(ratio), flush=True)
        rows.append(ratio)
    finish(args, header, rows)


def finish(args, header, rows):
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(header) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(header), flush=True)


if __name__ == "__main__":
    main()
