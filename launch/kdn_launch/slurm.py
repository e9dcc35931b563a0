"""`kdn-launch slurm submit | status | down`: a kdn deployment as one Slurm job
(docs/slurm.md).

`submit` renders RUN_DIR/kdn.sbatch from the template job.sbatch (beside this
file): a bash script that starts each role as an `srun` step on the job's
nodes (kdn-store and kdn-router on the first node, workers dealt over the
nodes in order; with --redis-cluster, a Redis primary on every node and its
replica on the next), with the command lines of argv.py, the builder `up`
uses too; then it submits the script with `sbatch`. The run folder is the
rendezvous: it must be on storage every node of the job sees. Each step
writes its stdout (whose first line is its endpoint, as under `up`) to
RUN_DIR/logs/NAME.out, its stderr to RUN_DIR/logs/NAME.log, and "NODE PID" to
RUN_DIR/pids/NAME; the job script reads the endpoints there and starts the
router with them.
"""

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from . import argv, redis_cluster
from .argv import Shell
from .plan import (GPU_SHARE, WorkerDevice, bin_dir_from_env, make_curve_keys, require_bins,
                   resolve_model)
from .procs import STOP_WAIT_S
from .util import Failure, http_get, info, log_tail, write_json

SBATCH_NAME = "kdn.sbatch"
RECORD_NAME = "slurm.json"
JOB_NAME = "kdn"
# States in which a job still holds (or waits for) its nodes.
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
               "RESIZING", "SIGNALING", "STAGE_OUT")
DOWN_WAIT_S = 30.0
SLURM_CMD_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ slurm


def require_tools(tools):
    for tool in tools:
        if shutil.which(tool) is None:
            raise Failure("%s is not installed or not on PATH: this machine is not a Slurm "
                            "client (Debian: apt-get install slurm-client)" % tool)


def slurm(cmd, check=True):
    """Runs a Slurm client command; (returncode, stdout, stderr). A missing
    command or a failure (with check) is a Failure carrying Slurm's words."""
    require_tools(cmd[:1])
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=SLURM_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Failure("%s did not answer within %.0f s (is slurmctld up?)"
                        % (" ".join(cmd), SLURM_CMD_TIMEOUT_S))
    if check and r.returncode != 0:
        raise Failure("%s failed: %s" % (" ".join(cmd),
                                           (r.stderr or r.stdout).strip() or "exit code %d"
                                           % r.returncode))
    return r.returncode, r.stdout, r.stderr


def job_info(job_id):
    """`scontrol show job` as a dict (JobState, Reason, NodeList, Command, ...);
    None when Slurm no longer knows the job."""
    rc, out, err = slurm(["scontrol", "show", "job", "--oneliner", str(job_id)], check=False)
    if rc != 0:
        if "Invalid job id" in err:
            return None
        raise Failure("scontrol show job %s failed: %s" % (job_id, err.strip()))
    fields = {}
    for field in out.split():
        if "=" in field:
            k, v = field.split("=", 1)
            fields.setdefault(k, v)
    return fields


def running_steps(job_id):
    """{step name: step id} of the job's steps that run now."""
    rc, out, _ = slurm(["squeue", "--steps", "--noheader", "--jobs", str(job_id),
                           "--format", "%i %j"], check=False)
    steps = {}
    if rc == 0:
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                steps[parts[1]] = parts[0]
    return steps


# ------------------------------------------------------------------ plan


def redis_placement(nodes):
    """[(name, node index)] of --redis-cluster's nodes: primary redis-pI on
    node I, its replica redis-rI on node I+1 (mod N), so that losing one node
    loses no primary together with its replica."""
    return ([("redis-p%d" % i, i) for i in range(nodes)] +
            [("redis-r%d" % i, (i + 1) % nodes) for i in range(nodes)])


def placement(prefill, decode, nodes):
    """[(name, role, node index)]: kdn-store and the router on node 0 (added by
    the script), workers dealt over the nodes in order, prefill first."""
    workers = [("prefill-%d" % i, "prefill") for i in range(prefill)]
    workers += [("decode-%d" % j, "decode") for j in range(decode)]
    return [(name, role, k % nodes) for k, (name, role) in enumerate(workers)]


def check_flags(a):
    """Refuses contradicting flags before anything reaches sbatch."""
    workers = a.prefill + a.decode
    if a.nodes > workers:
        raise Failure("--nodes %d asks for more nodes than there are workers (%d prefill + "
                        "%d decode): the extra nodes would sit idle" % (a.nodes, a.prefill,
                                                                        a.decode))
    if a.redis_cluster and a.nodes < redis_cluster.MIN_PRIMARIES:
        raise Failure("--redis-cluster puts one primary on each node and needs at least %d "
                      "(redis-cli --cluster create refuses fewer primaries); the job has "
                      "--nodes %d" % (redis_cluster.MIN_PRIMARIES, a.nodes))
    plan = placement(a.prefill, a.decode, a.nodes)
    if a.kv_transport in ("shm", "cuda_ipc") and a.nodes > 1:
        crossing = [(p, d) for p, rp, np_ in plan if rp == "prefill"
                    for d, rd, nd in plan if rd == "decode" and nd != np_]
        if crossing:
            raise Failure("--kv-transport %s cannot reach across nodes, and %s and %s are "
                            "placed on different nodes; use auto (shm within a node, tcp "
                            "across) or tcp" % ((a.kv_transport,) + crossing[0]))
    if a.gpus_per_worker == 0 and a.gpu_type:
        raise Failure("--gpu-type %s needs --gpus-per-worker" % a.gpu_type)
    if a.device == "cuda" and a.gpus_per_worker == 0:
        raise Failure("--device cuda needs --gpus-per-worker (Slurm gives each worker its "
                        "own GPUs; there is no --gpus list here)")
    if a.device == "cpu" and a.gpu_mem_fraction is not None:
        raise Failure("--gpu-mem-fraction needs --device cuda (with --device cpu no worker "
                        "uses a GPU)")
    for arg in a.sbatch_arg:
        if not arg.startswith("-"):
            raise Failure("--sbatch-arg %r is not an sbatch option (write it as "
                            "--sbatch-arg=--qos=high)" % arg)
        for own in ("--nodes", "-N", "--job-name", "-J", "--output", "-o", "--error", "-e",
                    "--partition", "-p", "--time", "-t", "--account", "-A"):
            if arg == own or arg.startswith(own + "=") or (len(own) == 2 and arg.startswith(own)
                                                         and not arg.startswith("--")):
                raise Failure("--sbatch-arg %s: set that with kdn-launch's own flag "
                                "(the job script sets it)" % arg)


# ------------------------------------------------------------------ script

TEMPLATE = Path(__file__).resolve().with_name("job.sbatch")


def render(template, values):
    """`template` with each @NAME@ replaced by values[NAME]; every value is
    used and every placeholder filled, or it is the launcher's own bug."""
    used = set()

    def fill(m):
        used.add(m.group(1))
        return values[m.group(1)]

    text = re.sub(r"@([A-Z_]+)@", fill, template)
    unused = set(values) - used
    if unused:
        raise AssertionError("%s has no place for %s" % (TEMPLATE, ", ".join(sorted(unused))))
    return text


def sbatch_lines(a, run_dir, per_node):
    lines = ["#SBATCH --job-name=%s" % JOB_NAME, "#SBATCH --nodes=%d" % a.nodes,
             "#SBATCH --ntasks-per-node=1"]
    if a.exclusive:
        lines.append("#SBATCH --exclusive")
    lines.append("#SBATCH --output=%s" % (run_dir / "logs" / "job.out"))
    if a.partition:
        lines.append("#SBATCH --partition=%s" % a.partition)
    if a.time:
        lines.append("#SBATCH --time=%s" % a.time)
    if a.account:
        lines.append("#SBATCH --account=%s" % a.account)
    if a.gpus_per_worker:
        # Every node is asked for the GPUs of its busiest share of workers,
        # so that sbatch refuses a request no node can hold.
        lines.append("#SBATCH --gres=gpu:%s%d" % (a.gpu_type + ":" if a.gpu_type else "",
                                                   a.gpus_per_worker * max(per_node)))
    for arg in a.sbatch_arg:
        lines.append("#SBATCH %s" % arg)
    return lines


def steps(a, bin_dir, model, plan):
    """The lines that start each role, their command lines from argv.py with
    the words the script computes (addresses, endpoints) as Shell words."""
    out = []
    store = None
    if a.store:
        out += ["# kdn-store on node 0; every worker reads and fills it.",
                "start store 0 -1 " + argv.bash_words(
                    argv.store_argv(a, bin_dir, Shell('"$(listen 0)"'))),
                "STORE=$(endpoint store tcp://) || abort", ""]
        store = Shell('"$STORE"')
    redis, password_file = a.kdn_redis, getattr(a, "kdn_redis_password_file", None)
    if a.redis_cluster:
        out.append("# The Redis Cluster: a primary on every node, its replica on the next node.")
        nodes = redis_placement(a.nodes)
        for k, (name, node) in enumerate(nodes):
            out.append("start %s %d -1 bash -c 'redis_main \"$@\"' redis_main \"${addrs[%d]}\" "
                       "\"$RUN/redis/%s\" \"$RUN/redis/common.conf\" %d %d"
                       % (name, node, node, name, k, len(nodes)))
        out += ["KDN_REDIS=$(redis_cluster %d) || abort" % a.nodes, ""]
        redis = Shell('"$KDN_REDIS"')
        password_file = Shell('"$RUN/%s"' % redis_cluster.PASSWORD_NAME)
    device = WorkerDevice("cpu")
    if a.device == "cuda":
        # step_main leaves each worker only its own GPUs in CUDA_VISIBLE_DEVICES,
        # so its first one is cuda:0, and no other worker shares it.
        device = WorkerDevice("cuda:0", a.gpu_mem_fraction if a.gpu_mem_fraction is not None
                              else GPU_SHARE)
    out.append("# The workers, dealt over the nodes in order: start NAME NODE GPU-SLOT COMMAND.")
    slots = [0] * a.nodes
    for name, role, node in plan:
        cmd = argv.worker_argv(a, bin_dir, model, name, role, Shell('"$(listen %d)"' % node),
                               store, device, redis, password_file)
        out.append("start %s %d %d %s" % (name, node, slots[node], argv.bash_words(cmd)))
        slots[node] += 1
    out.append("")
    for role in ("prefill", "decode"):
        var = role.upper()
        out.append('%s=""' % var)
        for name in [n for n, r, _ in plan if r == role]:
            out.append('%s="$%s${%s:+,}$(endpoint %s tcp://)" || abort' % (var, var, var, name))
    host = a.host if a.host else Shell('"${addrs[0]}"')
    router = argv.router_argv(a, bin_dir, model, Shell('"$PREFILL"'), Shell('"$DECODE"'), host)
    out += ["",
            "# The router on node 0, with the workers' endpoints; its first stdout line",
            "# is its URL, which `kdn-launch slurm status` reads from logs/router.out.",
            "start router 0 -1 " + argv.bash_words(router),
            "URL=$(endpoint router http://) || abort",
            'echo "kdn: serving on $URL"',
            "",
            "# Serve until scancel or the time limit; a step that ends is reported by",
            "# `kdn-launch slurm status`, and the router stops sending it work.",
            'while [ -n "$(jobs -pr)" ]; do wait -n; done',
            'echo "kdn: every step has ended"']
    return out


def script_text(a, bin_dir, model, run_dir):
    """The job script of a deployment: job.sbatch rendered for `a`."""
    q = shlex.quote
    plan = placement(a.prefill, a.decode, a.nodes)
    per_node = [sum(1 for _, _, n in plan if n == i) for i in range(a.nodes)]
    multi = a.nodes > 1
    return render(TEMPLATE.read_text(), {
        "SCRIPT": q(str(run_dir / SBATCH_NAME)),
        "PLACEMENT": "kdn-router%s on node 0;\n#   %s.%s" % (
            " and kdn-store" if a.store else "",
            ", ".join("%s on node %d" % (n, i) for n, _, i in plan),
            "\n#   Redis: primary redis-pI on node I, its replica redis-rI on node (I+1) mod %d."
            % a.nodes if a.redis_cluster else ""),
        "SBATCH_LINES": "\n".join(sbatch_lines(a, run_dir, per_node)),
        "RUN": q(str(run_dir)),
        "READY_TIMEOUT": "%d" % int(a.ready_timeout),
        "STOP_WAIT": "%d" % int(STOP_WAIT_S),
        "GPUS_PER_WORKER": "%d" % a.gpus_per_worker,
        "NODE_GPUS": "%d" % (a.gpus_per_worker * max(per_node)),
        "GPU_GRES": q(a.gpu_type + ":" if a.gpu_type else ""),
        "LISTEN_FN": 'echo "tcp://${addrs[$1]}:0"' if multi else 'echo "tcp://127.0.0.1:0"',
        "LISTEN_NOTE": ("The job spans nodes, so workers and kdn-store listen on their "
                        "node's\n# address (docs/slurm.md says what protects these ports)."
                        if multi else
                        "One node: workers and kdn-store listen on loopback; only the "
                        "router's\n# HTTP port is on the node's address."),
        "STEPS": "\n".join(steps(a, bin_dir, model, plan)),
    })


# ------------------------------------------------------------------ commands


def record_path(run_dir):
    return Path(run_dir) / RECORD_NAME


def read_record(run_dir):
    try:
        return json.loads(record_path(run_dir).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Failure("cannot read %s: %s" % (record_path(run_dir), e))


def job_state(job_id):
    """(state, reason, node list) of the job; state "GONE" when Slurm has
    forgotten it (it ended more than MinJobAge ago)."""
    fields = job_info(job_id)
    if fields is None:
        return "GONE", "", ""
    return fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""), fields.get("NodeList", "")


def first_line(path):
    try:
        with open(path, errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    return text.split("\n", 1)[0].strip() if "\n" in text else None


def write_redis_settings(a, run_dir):
    """A new password (RUN_DIR/redis.password) and the settings every Redis
    node shares with it (RUN_DIR/redis/common.conf), both mode 0600; each
    node adds its address, ports and folder when it starts (redis_main in
    the job script). An earlier job's node folders go: a node that keeps its
    nodes.conf refuses to join a new cluster."""
    folder = run_dir / redis_cluster.FOLDER_NAME
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    password = redis_cluster.make_password(run_dir)
    redis_cluster.write_private(folder / "common.conf", redis_cluster.common_conf(
        password, a.redis_maxmemory_mib, a.redis_node_timeout_ms))


def cmd_submit(a):
    check_flags(a)
    bin_dir = Path(a.bin_dir).resolve() if a.bin_dir else bin_dir_from_env()
    require_bins(bin_dir, ["kdn-prefill", "kdn-decode", "kdn-router", "kdn-keygen"] +
                   (["kdn-store"] if a.store else []))
    require_tools(("sbatch", "squeue", "scontrol", "scancel"))
    run_dir = Path(a.run_dir).resolve()
    old = read_record(run_dir)
    if old is not None:
        state, _, _ = job_state(old["job_id"])
        if state in LIVE_STATES:
            raise Failure("%s already holds job %s (%s); `kdn-launch slurm down %s` first, "
                            "or pick another --run-dir" % (run_dir, old["job_id"], state,
                                                           old["job_id"]))
    model = resolve_model(a, bin_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "pids"):
        d = run_dir / sub
        if d.is_dir():
            for f in d.iterdir():
                if f.is_file():
                    f.unlink()
        d.mkdir(exist_ok=True)
    a.curve_keys = make_curve_keys(bin_dir, run_dir)
    if a.redis_cluster:
        write_redis_settings(a, run_dir)
    script = run_dir / SBATCH_NAME
    script.write_text(script_text(a, bin_dir, model, run_dir))
    script.chmod(0o755)
    _, out, _ = slurm(["sbatch", "--parsable", str(script)])
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise Failure("sbatch printed %r, not a job id" % out.strip())
    record = {"job_id": job_id, "run_dir": str(run_dir), "script": str(script),
              "model": str(model), "nodes": a.nodes, "submitted": int(time.time()),
              "roles": ([{"name": "store", "role": "store", "node": 0}] if a.store else []) +
                       ([{"name": n, "role": "redis", "node": i}
                         for n, i in redis_placement(a.nodes)] if a.redis_cluster else []) +
                       [{"name": n, "role": r, "node": i} for n, r, i in placement(
                           a.prefill, a.decode, a.nodes)] +
                       [{"name": "router", "role": "router", "node": 0}]}
    write_json(record_path(run_dir), record)
    info("submitted %s as job %s (logs in %s)" % (script, job_id, run_dir / "logs"))
    print(job_id, flush=True)
    if not a.wait:
        return 0
    url = wait_ready(job_id, run_dir, a.ready_timeout)
    print("kdn: serving on %s" % url, flush=True)
    return 0


def wait_ready(job_id, run_dir, timeout):
    """Waits until the job's router answers /health 200; returns its URL. A job
    that ends first, or a timeout, is a Failure with what Slurm and the logs say."""
    deadline = time.monotonic() + timeout
    next_note = 0.0
    last = ""
    while True:
        state, reason, nodes = job_state(job_id)
        if state not in LIVE_STATES:
            raise Failure("job %s ended (%s%s) before the deployment served; %s"
                            % (job_id, state, ", " + reason if reason and reason != "None" else "",
                               failure_logs(run_dir)))
        url = None
        if state == "RUNNING":
            line = first_line(run_dir / "logs" / "router.out")
            if line and line.startswith("http://"):
                url = line.rstrip("/")
                status, body = http_get(url + "/health", timeout=2.0)
                if status == 200:
                    return url
                last = "%s/health: %s %s" % (url, status or "no answer", body.strip()[:200])
            else:
                last = "starting on %s" % nodes
        else:
            last = "%s (%s)" % (state, reason)
        now = time.monotonic()
        if now > deadline:
            raise Failure("job %s is not serving after %.0f s (%s); it stays queued or "
                            "running: `kdn-launch slurm status %s` shows it, `kdn-launch "
                            "slurm down %s` cancels it" % (job_id, timeout, last, job_id, job_id))
        if now >= next_note:
            info("waiting for job %s: %s" % (job_id, last))
            next_note = now + 3.0
        time.sleep(0.3)


def failure_logs(run_dir):
    job_out = run_dir / "logs" / "job.out"
    return "the end of %s:\n%s" % (job_out, log_tail(job_out))


def find_run_dir(a, job_id):
    """The run dir of job_id: --run-dir if given, else the folder of the job's
    script (scontrol's Command)."""
    if a.run_dir:
        run_dir = Path(a.run_dir).resolve()
    else:
        fields = job_info(job_id)
        if fields is None or not fields.get("Command"):
            raise Failure("Slurm no longer knows job %s; name its folder with --run-dir"
                            % job_id)
        run_dir = Path(fields["Command"]).parent
    rec = read_record(run_dir)
    if rec is None:
        raise Failure("%s has no %s: not a folder of `kdn-launch slurm submit`"
                        % (run_dir, RECORD_NAME))
    if str(rec.get("job_id")) != str(job_id):
        raise Failure("%s holds job %s, not %s" % (run_dir, rec.get("job_id"), job_id))
    return run_dir, rec


def cmd_status(a):
    job_id = str(a.job_id)
    run_dir, rec = find_run_dir(a, job_id)
    state, reason, nodes = job_state(job_id)
    print("job %s: %s%s%s" % (job_id, state,
                              " (%s)" % reason if reason and reason != "None" else "",
                              " on %s" % nodes if nodes and nodes != "(null)" else ""))
    running = running_steps(job_id) if state in LIVE_STATES else {}
    url = first_line(run_dir / "logs" / "router.out")
    health, body = None, None
    if url and url.startswith("http://") and state == "RUNNING":
        status, text = http_get(url.rstrip("/") + "/health")
        health = status
        try:
            body = json.loads(text)
        except ValueError:
            body = None
    workers = {w.get("name"): w for w in (body or {}).get("workers", [])}
    ok = state == "RUNNING"
    print("%-12s %-8s %-12s %8s  %-6s %-9s %s" % ("NAME", "ROLE", "NODE", "PID", "STEP",
                                                  "HEALTH", "ENDPOINT"))
    for r in rec["roles"]:
        name = r["name"]
        node, pid = "-", "-"
        try:
            node, pid = (run_dir / "pids" / name).read_text().split()[:2]
        except (OSError, ValueError):
            pass
        # A step that never started has no pid file yet: "-", not "ended".
        step = "up" if name in running else ("ended" if state == "RUNNING" and pid != "-"
                                             else "-")
        endpoint = first_line(run_dir / "logs" / (name + ".out")) or "-"
        if name in workers:
            w = workers[name]
            hl = "ok" if w.get("up") and w.get("compatible", True) else "down"
        elif r["role"] == "router":
            hl = ("ok" if health == 200 else "%s" % (health or "no answer")) \
                if state == "RUNNING" and step == "up" else "-"
        else:
            hl = "-"
        if step != "up" or hl not in ("ok", "-"):
            ok = False
        print("%-12s %-8s %-12s %8s  %-6s %-9s %s" % (name, r["role"], node, pid, step, hl,
                                                       endpoint))
    if url:
        print("router: %s" % url)
    else:
        print("router: no URL yet (the job is pending or starting; %s)"
              % (run_dir / "logs" / "job.out"))
        ok = False
    return 0 if ok else 1


def cmd_down(a):
    job_id = str(a.job_id)
    run_dir, _ = find_run_dir(a, job_id)
    state, _, _ = job_state(job_id)
    if state not in LIVE_STATES:
        print("job %s is not running (%s)" % (job_id, state))
        return 0
    if state == "RUNNING":
        # The job script stops its steps in order on SIGTERM (router, workers,
        # store); only its shell is signalled.
        info("asking job %s to stop its steps (router, workers, store)" % job_id)
        slurm(["scancel", "--batch", "--signal=TERM", job_id], check=False)
        if wait_gone(job_id, DOWN_WAIT_S):
            print("stopped job %s" % job_id)
            return 0
        info("job %s did not end within %.0f s: scancel" % (job_id, DOWN_WAIT_S))
    slurm(["scancel", job_id])
    if not wait_gone(job_id, DOWN_WAIT_S * 2):
        raise Failure("job %s still %s after scancel" % (job_id, job_state(job_id)[0]))
    print("stopped job %s" % job_id)
    return 0


def wait_gone(job_id, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_state(job_id)[0] not in LIVE_STATES:
            return True
        time.sleep(0.3)
    return False
