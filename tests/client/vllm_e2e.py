"""vLLM on the CPU with kdn.vllm as its KV connector, against a kdn deployment
on the same model (SmolLM2-135M-Instruct; vLLM runs the fp32 folder the gguf
package makes of kdn's GGUF). Run by scripts/test-vllm.sh with the
environment scripts/vllm-env.sh makes; not part of .ci/run.

  1. baseline: vLLM without a connector (its own prefix caching off): the
     greedy tokens of two prompts, P1 and P2;
  2. kdn serves P1 (its prefill worker stores P1's KV in kdn-store);
  3. vLLM with kdn.vllm (prefix caching off, so hits are the KDN's): P1 is a
     hit of its length less one, rounded down to vLLM's block size, and the
     tokens are the baseline's; P2 is a miss, its tokens the baseline's, and
     its KV is stored when its prefill ends;
  4. kdn serves P2: cached_tokens is the KDN lookup's over what vLLM stored,
     and the answer is kdn-generate's;
  5. vLLM with kdn.vllm on a Redis Cluster started as kdn-launch starts one
     (3 primaries, no replicas, a node timeout no run outlasts), the password
     in a file: P3 is stored; the primary holding the first chunks of P3 and
     P4 is SIGKILLed; a new vLLM serves P3 (a miss), P4 (its store dropped)
     and P1: every answer is the baseline's, the engine lives, the drop is
     logged, and no log holds the password.
Each vLLM run is a process of its own (vLLM's CPU engine spawns its workers).
Exits 0 when every check holds, else 1 with what failed.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "deploy"))
sys.path.insert(0, str(HERE.parent / "parity"))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "launch"))
sys.path.insert(0, str(HERE))

from prompts import text  # noqa: E402

NEW_TOKENS = 8
BLOCK = 128  # vLLM's CPU default block size


def log(msg):
    print("[vllm-e2e %s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def run_vllm(args):
    """One vLLM engine over the prompts in args.prompts; writes
    [{tokens, cached}] to args.out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    kw = {}
    if args.kdn_uri:
        extra = {"kdn_uri": args.kdn_uri, "kdn_model": args.gguf}
        if args.curve_keys:
            extra["kdn_curve_keys"] = args.curve_keys
        if args.password_file:
            extra["kdn_redis_password_file"] = args.password_file
        kw["kv_transfer_config"] = {
            "kv_connector": "KdnConnector", "kv_connector_module_path": "kdn.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    llm = LLM(model=args.folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=4096, seed=0, gpu_memory_utilization=0.5,
              enable_prefix_caching=False, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, detokenize=False,
                        ignore_eos=True)
    out = []
    for ids in prompts:
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        out.append(dict(tokens=list(r.outputs[0].token_ids), cached=r.num_cached_tokens or 0))
    Path(args.out).write_text(json.dumps(out))


def vllm_process(work, name, prompts, folder, gguf, kdn_uri=None, curve_keys=None,
                 password_file=None):
    pf, of = work / (name + "-prompts.json"), work / (name + "-out.json")
    pf.write_text(json.dumps(prompts))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--vllm", "--folder", str(folder), "--gguf", str(gguf),
           "--prompts", str(pf), "--out", str(of)]
    if kdn_uri:
        cmd += ["--kdn-uri", kdn_uri]
    if curve_keys:
        cmd += ["--curve-keys", str(curve_keys)]
    if password_file:
        cmd += ["--password-file", str(password_file)]
    t0 = time.time()
    with open(work / (name + ".log"), "w") as logf:
        r = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=900)
    if r.returncode != 0:
        tail = (work / (name + ".log")).read_text(errors="replace").splitlines()[-40:]
        raise SystemExit("vLLM run %s failed (exit %d); its log ends:\n%s"
                         % (name, r.returncode, "\n".join(tail)))
    log("vLLM %s: %.0f s" % (name, time.time() - t0))
    return json.loads(of.read_text())


def main():
    import gguf as gguf_pkg

    import kdn
    from deploy_util import BIN_DIR, Deployment, generate_ids, repeat_cached, wait_until
    from kdn_launch import redis_cluster
    from redis_shards import prompts_on
    from gguf_micro import smollm2_path
    from llama_cpp_tokenize import llama_cpp_ids
    from test_gguf import hf_folder

    os.environ.setdefault("KDN_LIB_DIR", str(BIN_DIR.parent / "lib"))
    model = smollm2_path()
    work = Path(tempfile.mkdtemp(prefix="kdn-vllm-e2e-"))
    log("work folder %s" % work)
    folder = hf_folder(gguf_pkg.GGUFReader(str(model)), work / "smollm2-hf")
    p1, p2 = llama_cpp_ids(model, [text(5, 9), text(6, 8)])
    failures = []

    def check(ok, what):
        log(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    # The Redis Cluster of step 5 first: which prompts fall on its first
    # primary decides what the baseline computes.
    cluster = redis_cluster.start_cluster(work / "redis", 3, node_timeout_ms=600000, replicas=0)
    password_file = redis_cluster.password_path(cluster.run_dir)
    rclient = kdn.Client(cluster.worker_url(), kdn.Model(model, "f32"),
                         redis_password_file=password_file)
    victim = cluster.nodes[0]
    p3, p4 = prompts_on(model, rclient.model, rclient, cluster, victim, 2, range(100, 130))

    base = vllm_process(work, "baseline", [p1, p2, p3, p4], folder, model)
    # f32 weights: vLLM's arithmetic (fp32 on the dequantized folder).
    d = Deployment(work / "run", model, "--store", "--store-host-mib", 256,
                   "--weights-dtype", "f32")
    try:
        store = next(p for p in d.info["processes"] if p["role"] == "store")
        uri = "kdn-store://" + store["endpoint"][len("tcp://"):]
        keys = d.run_dir / "curve.key"
        client = kdn.Client(uri, kdn.Model(model, "f32"), curve_keys=str(keys))
        d.completion(p1, max_tokens=1, temperature=0)
        check(wait_until(lambda: client.lookup(p1) == len(p1), 30),
              "kdn stored P1 (%d tokens)" % len(p1))
        check(client.lookup(p2) == 0, "P2 is not in the KDN")

        got = vllm_process(work, "kdn-connector", [p1, p2], folder, model, uri, keys)
        want = (len(p1) - 1) // BLOCK * BLOCK
        check(got[0]["cached"] == want and want > 0,
              "vLLM's P1: %d cached tokens from the KDN (want %d)" % (got[0]["cached"], want))
        check(got[0]["tokens"] == base[0]["tokens"],
              "vLLM's P1 tokens with the KDN's KV: %s; without: %s"
              % (got[0]["tokens"], base[0]["tokens"]))
        check(got[1]["cached"] == 0, "vLLM's P2: a miss (%d cached)" % got[1]["cached"])
        check(got[1]["tokens"] == base[1]["tokens"], "vLLM's P2 tokens are the baseline's")
        check(wait_until(lambda: client.lookup(p2) == len(p2), 10),
              "vLLM stored P2: the KDN reaches %d of %d tokens" % (client.lookup(p2), len(p2)))

        r = d.completion(p2, max_tokens=NEW_TOKENS, temperature=0)
        cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check(cached == repeat_cached(len(p2), 1) and cached > 0,
              "kdn's P2: %d cached tokens (want %d)" % (cached, repeat_cached(len(p2), 1)))
        ref = generate_ids(model, p2, NEW_TOKENS, "--weights-dtype", "f32")
        check(r["choices"][0]["text"].encode() == ref, "kdn's P2 answer is kdn-generate's")
        client.close()
    finally:
        d.down()

    try:
        password = password_file.read_text().strip()
        got = vllm_process(work, "redis-store", [p3], folder, model, cluster.worker_url(),
                           password_file=password_file)
        check(got[0]["tokens"] == base[2]["tokens"], "vLLM's P3 on Redis: the baseline's tokens")
        check(wait_until(lambda: rclient.lookup(p3) == len(p3), 30),
              "vLLM stored P3 in Redis: the KDN reaches %d of %d tokens"
              % (rclient.lookup(p3), len(p3)))
        victim.proc.popen.send_signal(signal.SIGKILL)
        victim.proc.popen.wait(timeout=30)
        log("killed %s, which holds the first chunks of P3 and P4" % victim.name)
        got = vllm_process(work, "redis-dead-shard", [p3, p4, p1], folder, model,
                           cluster.worker_url(), password_file=password_file)
        check(got[0]["cached"] == 0 and got[0]["tokens"] == base[2]["tokens"],
              "vLLM's P3 with its shard dead: a miss (%d cached), the baseline's tokens"
              % got[0]["cached"])
        check(got[1]["tokens"] == base[3]["tokens"], "vLLM's P4, stored on the dead shard: the "
              "baseline's tokens")
        check(got[2]["tokens"] == base[0]["tokens"], "vLLM lives on: P1 is the baseline's")
        text_log = (work / "redis-dead-shard.log").read_text(errors="replace")
        check("taken as nothing stored" in text_log, "the dropped store is logged")
        logs = "".join(f.read_text(errors="replace") for f in work.glob("*.log"))
        check(password not in logs, "no vLLM log holds the Redis password")
        rclient.close()
    finally:
        cluster.stop(quiet=True)
    if failures:
        log("%d check(s) failed" % len(failures))
        sys.exit(1)
    log("all checks passed")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--folder", "--gguf", "--prompts", "--out", "--kdn-uri", "--curve-keys",
                 "--password-file"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.vllm:
        run_vllm(a)
    else:
        main()
