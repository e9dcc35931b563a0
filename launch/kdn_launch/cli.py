"""The flags of every command (`up`, `down`, `status`, `demo`, `slurm ...`)
and main(): usage errors exit 2, failures 1 with one line on stderr."""

import argparse
import os
import sys

from . import argv, demo, local, redis_cluster, slurm
from .plan import (DEFAULT_MODEL, FALLBACK_MODEL, FALLBACK_MODEL_MKMODEL_ARGS, GPU_SHARE,
                   default_bin_dir)
from .procs import STOP_WAIT_S
from .util import REPO, Failure, Interrupted

# kdn-prefill/kdn-decode --store-codec (kvbus::ParseCodecLevel).
CODEC_LEVELS = ["raw", "lossless"] + ["q%d" % b for b in range(2, 9)]
# Every process's --log-level (kdn::ParseLogLevel).
LOG_LEVELS = ["trace", "debug", "info", "warn", "error", "off"]


class Parser(argparse.ArgumentParser):
    """Usage errors: one line on stderr, exit code 2."""

    def error(self, message):
        sys.stderr.write("%s: error: %s (see %s --help)\n" % (self.prog, message, self.prog))
        sys.exit(2)


def ratio_value(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a number" % text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("%r must be between 0 and 1" % text)
    return v


def reserve_share(text):
    v = ratio_value(text)
    if v > 0.99:
        raise argparse.ArgumentTypeError("%r must be at most 0.99" % text)
    return v


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not an integer" % text)
    if v < 1:
        raise argparse.ArgumentTypeError("%r must be at least 1" % text)
    return v


def nonneg_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not an integer" % text)
    if v < 0:
        raise argparse.ArgumentTypeError("%r must not be negative" % text)
    return v


def port_number(text):
    v = nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError("%r is not a port" % text)
    return v


def positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a number" % text)
    if not v > 0:
        raise argparse.ArgumentTypeError("%r must be positive" % text)
    return v


def redis_primaries(text):
    """--redis-cluster N: redis-cli --cluster create needs 3 primaries."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not an integer" % text)
    if v < redis_cluster.MIN_PRIMARIES:
        raise argparse.ArgumentTypeError(
            "%r: a Redis Cluster needs at least %d primaries (redis-cli --cluster create "
            "refuses fewer)" % (text, redis_cluster.MIN_PRIMARIES))
    return v


def redis_url(text):
    """--kdn-redis: redis://[USER:PASS@ or :PASS@]HOST:PORT[,HOST:PORT...]."""
    scheme = "redis://"
    if not text.startswith(scheme):
        raise argparse.ArgumentTypeError("%r does not begin with %s (redis://[USER:PASS@]"
                                         "HOST:PORT[,HOST:PORT...])"
                                         % (argv.redact_url(text), scheme))
    seeds = text[len(scheme):].rsplit("@", 1)[-1]
    for seed in seeds.split(","):
        host, _, port = seed.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError("%r: %r is not HOST:PORT (redis://[USER:PASS@]"
                                             "HOST:PORT[,HOST:PORT...])"
                                             % (argv.redacted([text])[0], seed))
    return text


def password_file(text):
    """--kdn-redis-password-file: a readable file, as an absolute path (the
    workers may start elsewhere: on other nodes of a Slurm job it must lie
    on a file system they share)."""
    path = os.path.abspath(text)
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError("%r is not a file" % text)
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError("%r cannot be read" % text)
    return path


def check_redis_password(parser, args):
    """--kdn-redis-password-file goes with a --kdn-redis URL that has no
    password of its own (the workers refuse both)."""
    file = getattr(args, "kdn_redis_password_file", None)
    if file is None:
        return
    url = getattr(args, "kdn_redis", None)
    if url is None:
        parser.error("--kdn-redis-password-file goes with --kdn-redis")
    cred = url[len("redis://"):].rpartition("@")[0]
    if ":" in cred:
        parser.error("--kdn-redis %s has a password already: give it in the URL or in "
                     "--kdn-redis-password-file, not both" % argv.redact_url(url))


def gpu_list(text):
    """--gpus: CUDA device ids, comma-separated, each listed once."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(
                "%r is not a comma-separated list of GPU ids (like 0,1): %r is not a "
                "non-negative integer" % (text, part))
        if int(part) in ids:
            raise argparse.ArgumentTypeError("%r lists GPU %d twice" % (text, int(part)))
        ids.append(int(part))
    return ids


def mem_fraction(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a number" % text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError("%r must be more than 0 and at most 1" % text)
    return v


def add_run_dir(p, default=str(local.RUN_DIR),
                help="folder of deployment.json and logs/ (default: %(default)s)"):
    p.add_argument("--run-dir", default=default, metavar="DIR", help=help)


def add_up_flags(p, run_dir_default=str(local.RUN_DIR), port_default=8000, host_default="127.0.0.1",
                 host_help="router HTTP address (default: %(default)s)",
                 run_dir_help="folder of deployment.json and logs/ (default: %(default)s)",
                 slurm_job=False):
    p.add_argument("--model", metavar="PATH",
                   help="model folder or .gguf file (default: %s, made by tools/train/, when present; "
                   "otherwise %s, generated with kdn-mkmodel %s)"
                   % (DEFAULT_MODEL, FALLBACK_MODEL, " ".join(FALLBACK_MODEL_MKMODEL_ARGS)))
    p.add_argument("--prefill", type=positive_int, default=1, metavar="N",
                   help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=positive_int, default=1, metavar="M",
                   help="decode workers (default: %(default)s)")
    shared = p.add_mutually_exclusive_group()
    shared.add_argument("--store", action="store_true",
                        help="also start a shared kdn-store that every worker reads and fills")
    if slurm_job:
        shared.add_argument("--redis-cluster", action="store_true",
                            help="also start a Redis Cluster that every worker reads and "
                            "fills: a primary on every node of the job and its replica on "
                            "the next node, with a new password (at least 3 nodes; "
                            "docs/slurm.md, \"Redis Cluster\")")
    else:
        shared.add_argument("--redis-cluster", type=redis_primaries, metavar="N",
                            help="also start a Redis Cluster that every worker reads and "
                            "fills: N primaries (at least 3) with one replica each, on "
                            "loopback, with a new password (docs/launch.md, \"Redis "
                            "Cluster\")")
    shared.add_argument("--kdn-redis", type=redis_url, metavar="URL",
                        help="an existing Redis Cluster every worker reads and fills, passed "
                        "to the workers as it is: redis://[USER:PASS@]HOST:PORT[,HOST:PORT...] "
                        "(the seed nodes)")
    p.add_argument("--kdn-redis-password-file", type=password_file, metavar="FILE",
                   help="with --kdn-redis: a file whose first line is the cluster's password, "
                   "which the URL then leaves out; the workers read it there, so no command "
                   "line shows it (a --redis-cluster deployment's is RUN_DIR/%s)"
                   % redis_cluster.PASSWORD_NAME)
    p.add_argument("--redis-maxmemory-mib", type=positive_int,
                   default=redis_cluster.DEFAULT_MAXMEMORY_MIB, metavar="MIB",
                   help="with --redis-cluster: each primary's maxmemory in MiB, past which it "
                   "evicts the least recently used keys (default: %(default)s)")
    p.add_argument("--redis-node-timeout-ms", type=positive_int,
                   default=redis_cluster.DEFAULT_NODE_TIMEOUT_MS, metavar="MS",
                   help="with --redis-cluster: cluster-node-timeout, how long a node may be "
                   "unreachable before its replica takes over (default: %(default)s)")
    p.add_argument("--store-host-mib", type=positive_float, default=4096, metavar="MIB",
                   help="kdn-store host-memory tier in MiB (default: %(default)s)")
    p.add_argument("--store-codec", choices=CODEC_LEVELS, default="raw", metavar="LEVEL",
                   help="KV codec level of the chunks workers put into the kdn-store or the "
                        "Redis Cluster: raw, "
                        "lossless, or q2 ... q8, quantized at that many bits in the deepest "
                        "layers (docs/kvbus.md, \"KV codec\"; default: %(default)s)")
    p.add_argument("--host-mib", type=positive_float, default=2048, metavar="MIB",
                   help="each worker's own host-memory KV tier in MiB (default: %(default)s)")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, metavar="T",
                   help="tokens per KV chunk, the unit of caching (default: %(default)s)")
    p.add_argument("--kv-transport", choices=("auto", "tcp", "shm", "cuda_ipc", "nccl"),
                   default="auto",
                   help="how prefill workers move KV to decode workers: auto picks shm "
                        "(shared memory) on one host and tcp otherwise; cuda_ipc, for GPU "
                        "workers on one host, has them write KV into the decode workers' GPU "
                        "memory; nccl, for GPU workers on any hosts, has them send it there "
                        "over NCCL (both not yet run on a GPU) (default: %(default)s)")
    # These are passed only when given: their default is the process's own.
    p.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="kdn-decode --max-batch, to every decode worker: requests each runs, "
                        "holds prepared or has preempted at once (default: kdn-decode's own)")
    p.add_argument("--decode-kv-tokens", type=positive_int, metavar="N",
                   help="kdn-decode --kv-tokens, to every decode worker: tokens of KV its "
                        "pool holds; past them it preempts (docs/serving.md, \"Admission and "
                        "preemption\"; default: kdn-decode's own)")
    p.add_argument("--max-queued", type=nonneg_int, metavar="N",
                   help="kdn-router --max-queued: requests that may wait at the router for a "
                        "decode worker with room, before any prefill is spent on them; past "
                        "that, 429 (default: kdn-router's own)")
    p.add_argument("--max-connections", type=positive_int, metavar="N",
                   help="kdn-router --max-connections: open HTTP connections the router takes "
                        "at most; one more is answered 503 and closed (default: kdn-router's "
                        "own)")
    p.add_argument("--max-body-buffer-mib", type=positive_int, metavar="MIB",
                   help="kdn-router --max-body-buffer-mib: request-body MiB the router buffers "
                        "at most over all connections; a body past it is answered 503 with "
                        "Retry-After before it is read (at least 16; default: kdn-router's "
                        "own)")
    p.add_argument("--max-pinned-mib", type=nonneg_int, metavar="MIB",
                   help="kdn-router --max-pinned-mib: KV MiB (counted as f32) the live pins "
                        "of one tenant may hold; a request's cache_control past it is refused "
                        "with 429, and 0 refuses every pin (docs/serving.md, \"Pinning a "
                        "prefix\"; default: kdn-router's own)")
    p.add_argument("--disaggregation", choices=("always", "auto", "never"),
                   help="kdn-router --disaggregation: where prompts are computed, always on a "
                        "prefill worker, never (on the decode worker, but blended and resumed "
                        "requests) or auto by placement's cost model (docs/serving.md, \"Two "
                        "paths\"; default: kdn-router's own)")
    p.add_argument("--local-prefill-max-tokens", type=positive_int, metavar="N",
                   help="kdn-router --local-prefill-max-tokens: with auto, the most prompt "
                        "tokens a decode worker lacks for it to prefill the prompt itself "
                        "(default: kdn-router's own)")
    p.add_argument("--local-prefill-step-tokens", type=positive_int, metavar="N",
                   help="kdn-decode --local-prefill-step-tokens, to every decode worker: "
                        "prompt tokens a local prefill computes between two decode steps while "
                        "requests run (default: kdn-decode's own)")
    p.add_argument("--decode-prepare-timeout-ms", type=positive_int, metavar="MS",
                   help="kdn-decode --prepare-timeout-ms, to every decode worker: a prepared "
                        "request its router neither started nor renewed (it renews the ones it "
                        "still wants with every ping) this long is dropped (docs/serving.md, "
                        "\"Reservations\"; default: kdn-decode's own)")
    p.add_argument("--decode-admission-reserve", type=reserve_share, metavar="F",
                   help="kdn-decode --admission-reserve, to every decode worker: the share of "
                        "its KV pool a new request must leave free while others hold blocks "
                        "(docs/serving.md, \"Admission and preemption\"; default: kdn-decode's "
                        "own)")
    p.add_argument("--no-resume", action="store_true",
                   help="a request whose decode worker is lost mid-stream fails instead of "
                        "going on at another decode worker (docs/serving.md, \"A decode worker "
                        "lost\")")
    p.add_argument("--port", type=port_number, default=port_default,
                   help="router HTTP port, 0 lets the OS pick (default: %(default)s)")
    p.add_argument("--host", default=host_default, help=host_help)
    p.add_argument("--separator", default="", metavar="STR",
                   help="kdn-router --separator: a string that marks document boundaries in "
                        "prompts (default: none)")
    p.add_argument("--recompute-ratio", type=ratio_value, default=0.15, metavar="R",
                   help="kdn-router --recompute-ratio: the share of a prompt's cached document "
                        "tokens that blend recomputes (default: 0.15)")
    p.add_argument("--emphasis-heads", metavar="FILE",
                   help="kdn-router --emphasis-heads: a head profile (the JSON `kdn-bench "
                        "kv-edit --json` writes) naming the heads a request's emphasized "
                        "phrases are biased in (docs/serving.md, \"Emphasis\"; default: "
                        "kdn-router's own, the middle third of the layers)")
    p.add_argument("--emphasis-strength", type=positive_float, metavar="S",
                   help="kdn-router --emphasis-strength: the bias a request's emphasis gets "
                        "when it names none (default: kdn-router's own)")
    p.add_argument("--api-keys", metavar="FILE",
                   help="kdn-router --api-keys: a file of \"KEY TENANT\" lines; the API then "
                        "needs a key and each tenant's cache is its own (default: none)")
    p.add_argument("--threads", type=nonneg_int, default=0, metavar="T",
                   help="CPU threads per worker, 0 = all cores (default: %(default)s)")
    p.add_argument("--weights-dtype", choices=("native", "f32"), default="native",
                   help="workers' --weights-dtype on the CPU: native computes with the file's "
                        "quantized or 16-bit weights, f32 widens them at load "
                        "(default: %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, metavar="LEVEL",
                   help="every process's --log-level: %s; each line has a timestamp, the "
                   "level, the process and the message, and a request's lines carry "
                   "req=ID in every process (docs/serving.md, \"Logs\"; default: "
                   "$KDN_LOG_LEVEL, else info)" % ", ".join(LOG_LEVELS))
    p.add_argument("--bin-dir", metavar="DIR",
                   help="folder of the kdn binaries (default: $KDN_BIN_DIR, else %s)"
                   % default_bin_dir())
    add_run_dir(p, run_dir_default, run_dir_help)
    p.add_argument("--ready-timeout", type=positive_float, default=120, metavar="S",
                   help="seconds to wait for each process's endpoint, then for /health "
                   "(default: %(default)s)")


def add_local_flags(p):
    """The flags of `up` and `demo` that `slurm submit` does not take."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers' engines run: cpu, or cuda on the GPUs of --gpus; "
                   "with cpu no --device flag is passed to the workers (default: %(default)s)")
    p.add_argument("--gpus", type=gpu_list, metavar="LIST",
                   help="with --device cuda: CUDA device ids (as the workers see them, after "
                   "CUDA_VISIBLE_DEVICES), comma-separated, each once, at most one per worker. "
                   "Workers are dealt over them round-robin in start order, prefill-0, "
                   "prefill-1, ..., then decode-0, ...; several may share a GPU. Each worker "
                   "gets --device cuda:ID (default: 0)")
    p.add_argument("--gpu-mem-fraction", type=mem_fraction, metavar="F",
                   help="with --device cuda: the share of its GPU's memory each worker may take "
                   "(kdn-prefill/kdn-decode --gpu-mem-fraction); the workers on one GPU must "
                   "not sum over 1 (default: %g/k for each of the k workers on a GPU, rounded "
                   "down to 4 decimals)" % GPU_SHARE)
    p.add_argument("--kv-events-port", type=port_number, metavar="PORT",
                   help="publish each worker's KV events (what its host tier gains and drops, "
                   "as vLLM's KV events; docs/serving.md, \"KV events\") on loopback: the "
                   "k-th worker in start order (prefill-0, ..., decode-0, ...) on port "
                   "PORT+2k, its replay socket on PORT+2k+1")
    p.add_argument("--lookups-from-events", action="store_true",
                   help="with --kv-events-port: the routers follow the workers' KV events and "
                   "take a prompt's cached prefix at a worker from them instead of asking it "
                   "(kdn-router --lookups-from-events; docs/serving.md, \"Lookups from the "
                   "event stream\")")
    p.add_argument("--no-curve", action="store_true",
                   help="run the internal sockets (control, kvbus, kdn-store) in plaintext. By "
                   "default the launcher writes new CURVE keys to RUN_DIR/curve.key and "
                   "router.key (mode 0600) and every process encrypts and refuses peers "
                   "without them; every port "
                   "of a local deployment is on loopback, where plaintext is faster (kdn-bench "
                   "pd-transfer --curve measures the cost) but any local process is trusted")
    p.add_argument("--dry-run", action="store_true",
                   help="check the flags and print each process's command line "
                   "(\"NAME: COMMAND\", endpoints not yet known as NAME-ENDPOINT) in start "
                   "order; start nothing")


def add_slurm_commands(sub):
    """`slurm submit | status | down` (slurm.py)."""
    sl = sub.add_parser(
        "slurm", help="run the deployment as a Slurm job (submit, status, down)",
        description="The deployment as one Slurm job (docs/slurm.md): `submit` writes "
        "RUN_DIR/kdn.sbatch and submits it, `status JOBID` shows it, `down JOBID` stops it. "
        "RUN_DIR must be on storage every node of the job sees.")
    ssub = sl.add_subparsers(dest="slurm_command", metavar="COMMAND", parser_class=Parser)
    sl.set_defaults(func=lambda args: sl.error("a command is required: submit, status or down"))

    sb = ssub.add_parser(
        "submit", help="write the job script and sbatch it",
        description="Write RUN_DIR/kdn.sbatch (kdn-router, and kdn-store with --store, on the "
        "job's first node; workers dealt over the nodes in order, prefill first; with "
        "--redis-cluster a Redis primary on every node and its replica on the next), submit it "
        "with sbatch, and print the job id on stdout. With --wait, also wait until the "
        "router answers /health and print 'kdn: serving on URL'. Logs: RUN_DIR/logs/NAME.log "
        "(stderr), NAME.out (stdout), job.out (the job script).")
    add_up_flags(sb, run_dir_default=str(REPO / ".kdn-slurm"), port_default=0,
                   host_default=None, run_dir_help="folder of kdn.sbatch, slurm.json, logs/ and "
                   "pids/, on storage every node sees (default: %(default)s)",
                   host_help="router HTTP address (default: the first node's address)",
                   slurm_job=True)
    sb.add_argument("--nodes", type=positive_int, default=1, metavar="N",
                    help="nodes of the job (default: %(default)s); at most one per worker")
    sb.add_argument("--partition", metavar="NAME", help="sbatch --partition")
    sb.add_argument("--time", metavar="LIMIT", help="sbatch --time (e.g. 2:00:00)")
    sb.add_argument("--account", metavar="NAME", help="sbatch --account")
    sb.add_argument("--gpus-per-worker", type=nonneg_int, default=0, metavar="G",
                    help="GPUs of each worker: the job asks each node for the GPUs of the "
                    "workers placed on it (sbatch --gres=gpu:N) and each worker gets its own "
                    "G of them in CUDA_VISIBLE_DEVICES (default: %(default)s)")
    sb.add_argument("--gpu-type", default="", metavar="TYPE",
                    help="GPU type in the gres request (gpu:TYPE:G), as the cluster names it")
    sb.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the workers' engines run: cpu, or cuda (needs "
                    "--gpus-per-worker): each worker gets --device cuda:0, the first of its own "
                    "GPUs; with cpu no --device flag is passed (default: %(default)s)")
    sb.add_argument("--gpu-mem-fraction", type=mem_fraction, metavar="F",
                    help="with --device cuda: the share of its GPU's memory each worker may "
                    "take (kdn-prefill/kdn-decode --gpu-mem-fraction; default: %g, as no two "
                    "workers share a GPU)" % GPU_SHARE)
    sb.add_argument("--no-exclusive", dest="exclusive", action="store_false",
                    help="do not ask for whole nodes (sbatch --exclusive is the default: "
                    "workers use every core of their node)")
    sb.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                    help="one more sbatch option, as --sbatch-arg=--qos=high (repeatable)")
    sb.add_argument("--wait", action="store_true",
                    help="wait (up to --ready-timeout) until the router answers /health, "
                    "then print its URL")
    sb.set_defaults(func=lambda args: slurm.cmd_submit(args))

    st = ssub.add_parser(
        "status", help="show the job, each role's node, pid and health",
        description="Print the job's state, then each role: its node, pid, whether its srun "
        "step runs, its health as the router sees it, and its endpoint; then the router's "
        "URL. Exit code 0 when the job runs and every role is up and healthy, 1 otherwise.")
    st.add_argument("job_id", metavar="JOBID", type=positive_int)
    st.add_argument("--run-dir", metavar="DIR",
                    help="the job's folder (default: the folder of its script, from scontrol)")
    st.set_defaults(func=lambda args: slurm.cmd_status(args))

    dn = ssub.add_parser(
        "down", help="stop the job cleanly (scancel)",
        description="Signal the job script, which stops the router, then the workers, then "
        "kdn-store or the Redis nodes; if the job has not ended within %.0f s, scancel it."
        % slurm.DOWN_WAIT_S)
    dn.add_argument("job_id", metavar="JOBID", type=positive_int)
    dn.add_argument("--run-dir", metavar="DIR",
                    help="the job's folder (default: the folder of its script, from scontrol)")
    dn.set_defaults(func=lambda args: slurm.cmd_down(args))
    return sl


def build_parser():
    top = Parser(prog="kdn-launch",
                 description="Start, stop and inspect a local kdn deployment: kdn-router, "
                 "N kdn-prefill and M kdn-decode workers and an optional kdn-store or Redis "
                 "Cluster (docs/serving.md).")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    up = sub.add_parser(
        "up", help="start a deployment",
        description="Start kdn-store (with --store) or a Redis Cluster (with --redis-cluster), "
        "the prefill and decode workers and kdn-router; wait until GET /health answers 200; "
        "print the URL as the last stdout line ('kdn: serving on URL'). Processes log to "
        "RUN_DIR/logs/NAME.log (stderr) and NAME.out (stdout); RUN_DIR/deployment.json names "
        "them. Without --detach it stays in "
        "the foreground, reports a process that dies, and stops everything on Ctrl-C or "
        "SIGTERM. A process that exits before it serves fails `up` with the end of its log. "
        "Workers get GOMP_SPINCOUNT=3000 (idle OpenMP threads spin about 0.2 ms, then sleep) "
        "unless the environment sets it or OMP_WAIT_POLICY. With --device "
        "cuda each worker also gets --device cuda:ID --gpu-mem-fraction F (--gpus, "
        "--gpu-mem-fraction).")
    add_up_flags(up)
    add_local_flags(up)
    up.add_argument("--routers", type=positive_int, default=1, metavar="N",
                    help="start N routers over the same workers (docs/serving.md, \"More than "
                    "one router\"): \"router\" on --port, \"router-1\" ... on the ports after "
                    "it (with --port 0 each on a free port); each serves any request, and one "
                    "that dies leaves the others serving. The last stdout line names the first "
                    "(default: %(default)s)")
    up.add_argument("--detach", action="store_true",
                    help="return once the deployment is ready and leave it running "
                    "(stop it with kdn-launch down)")
    up.set_defaults(func=local.cmd_up)

    dn = sub.add_parser(
        "down", help="stop the deployment",
        description="Stop the processes RUN_DIR/deployment.json names: SIGTERM to the router, "
        "then the workers, then kdn-store or the Redis nodes, each given %.0f s before "
        "SIGKILL; then remove deployment.json, the CURVE keys and the Redis password. A "
        "foreground kdn-launch up is asked to do it itself."
        % STOP_WAIT_S)
    add_run_dir(dn)
    dn.set_defaults(func=local.cmd_down)

    st = sub.add_parser(
        "status", help="show the deployment's processes and /health",
        description="Print each process of RUN_DIR/deployment.json (name, role, pid, "
        "alive or dead, a worker's device and GPU memory fraction, endpoint), then the "
        "router's GET /health. Exit code 0 when every process is alive and /health answers "
        "200, 1 otherwise (also when nothing runs).")
    add_run_dir(st)
    st.set_defaults(func=local.cmd_status)

    dm = sub.add_parser(
        "demo", help="start a deployment, send sample requests, stop it",
        description="Like up, then send requests and print what comes back as it arrives: "
        "a three-turn chat over a section of the Apache License 2.0 (later turns show their "
        "tokens cached in the KDN and their time to first token beside the first turn's), "
        "then a question over three of its sections sent as documents, asked again with the "
        "documents reversed (blended from their stored KV instead of recomputed, and the "
        "time saved); with a model folder holding demo.json (models/kdn-qa), its questions "
        "instead. Stops the deployment unless --keep. scripts/demo.sh runs it on "
        "SmolLM2-135M-Instruct.")
    add_up_flags(dm)
    add_local_flags(dm)
    dm.add_argument("--keep", action="store_true",
                    help="leave the deployment running afterwards (stop it with kdn-launch down)")
    dm.add_argument("--transcript", metavar="PATH",
                    help="also write every request sent and its answer, usage and time to "
                    "first token to PATH (JSON)")
    dm.set_defaults(func=demo.cmd_demo)

    add_slurm_commands(sub)
    return top


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.error("a command is required: up, down, status, demo or slurm")
    check_redis_password(parser, args)
    try:
        return args.func(args)
    except Failure as e:
        print("kdn-launch: error: %s" % e, file=sys.stderr)
        return 1
    except BrokenPipeError:
        # stdout went to a pipe that closed (`kdn-launch status | head`).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        print("kdn-launch: error: %s" % e, file=sys.stderr)
        return 1
    except Interrupted:
        return 130


if __name__ == "__main__":
    sys.exit(main())
