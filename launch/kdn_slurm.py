"""`kdn-launch slurm submit | status | down`: a kdn deployment as one Slurm job
(docs/slurm.md).

`submit` writes RUN_DIR/kdn.sbatch, a bash script that starts each role as an
`srun` step on the job's nodes (kdn-store and kdn-router on the first node,
workers dealt over the nodes in order), and submits it with `sbatch`. The run
folder is the rendezvous: it must be on storage every node of the job sees.
Each step writes its stdout (whose first line is its endpoint, as under `up`)
to RUN_DIR/logs/NAME.out, its stderr to RUN_DIR/logs/NAME.log, and "NODE PID"
to RUN_DIR/pids/NAME; the job script reads the endpoints there and starts the
router with them.

Part of launch/kdn-launch, which passes itself in as `L` (Failure, info,
http_get, log_tail, the shared flags): standard library only.
"""

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

SBATCH_NAME = "kdn.sbatch"
RECORD_NAME = "slurm.json"
JOB_NAME = "kdn"
# States in which a job still holds (or waits for) its nodes.
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
               "RESIZING", "SIGNALING", "STAGE_OUT")
DOWN_WAIT_S = 30.0
SLURM_CMD_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ slurm


def require_tools(L, tools):
    for tool in tools:
        if shutil.which(tool) is None:
            raise L.Failure("%s is not installed or not on PATH: this machine is not a Slurm "
                            "client (Debian: apt-get install slurm-client)" % tool)


def slurm(L, cmd, check=True):
    """Runs a Slurm client command; (returncode, stdout, stderr). A missing
    command or a failure (with check) is a Failure carrying Slurm's words."""
    require_tools(L, cmd[:1])
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=SLURM_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise L.Failure("%s did not answer within %.0f s (is slurmctld up?)"
                        % (" ".join(cmd), SLURM_CMD_TIMEOUT_S))
    if check and r.returncode != 0:
        raise L.Failure("%s failed: %s" % (" ".join(cmd),
                                           (r.stderr or r.stdout).strip() or "exit code %d"
                                           % r.returncode))
    return r.returncode, r.stdout, r.stderr


def job_info(L, job_id):
    """`scontrol show job` as a dict (JobState, Reason, NodeList, Command, ...);
    None when Slurm no longer knows the job."""
    rc, out, err = slurm(L, ["scontrol", "show", "job", "--oneliner", str(job_id)], check=False)
    if rc != 0:
        if "Invalid job id" in err:
            return None
        raise L.Failure("scontrol show job %s failed: %s" % (job_id, err.strip()))
    info = {}
    for field in out.split():
        if "=" in field:
            k, v = field.split("=", 1)
            info.setdefault(k, v)
    return info


def running_steps(L, job_id):
    """{step name: step id} of the job's steps that run now."""
    rc, out, _ = slurm(L, ["squeue", "--steps", "--noheader", "--jobs", str(job_id),
                           "--format", "%i %j"], check=False)
    steps = {}
    if rc == 0:
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                steps[parts[1]] = parts[0]
    return steps


# ------------------------------------------------------------------ plan


def placement(prefill, decode, nodes):
    """[(name, role, node index)]: kdn-store and the router on node 0 (added by
    the script), workers dealt over the nodes in order, prefill first."""
    workers = [("prefill-%d" % i, "prefill") for i in range(prefill)]
    workers += [("decode-%d" % j, "decode") for j in range(decode)]
    return [(name, role, k % nodes) for k, (name, role) in enumerate(workers)]


def check_flags(L, a):
    """Refuses contradicting flags before anything reaches sbatch."""
    workers = a.prefill + a.decode
    if a.nodes > workers:
        raise L.Failure("--nodes %d asks for more nodes than there are workers (%d prefill + "
                        "%d decode): the extra nodes would sit idle" % (a.nodes, a.prefill,
                                                                        a.decode))
    plan = placement(a.prefill, a.decode, a.nodes)
    if a.kv_transport == "shm" and a.nodes > 1:
        crossing = [(p, d) for p, rp, np_ in plan if rp == "prefill"
                    for d, rd, nd in plan if rd == "decode" and nd != np_]
        if crossing:
            raise L.Failure("--kv-transport shm cannot reach across nodes, and %s and %s are "
                            "placed on different nodes; use auto (shm within a node, tcp "
                            "across) or tcp" % crossing[0])
    if a.gpus_per_worker == 0 and a.gpu_type:
        raise L.Failure("--gpu-type %s needs --gpus-per-worker" % a.gpu_type)
    if a.device == "cuda" and a.gpus_per_worker == 0:
        raise L.Failure("--device cuda needs --gpus-per-worker (Slurm gives each worker its "
                        "own GPUs; there is no --gpus list here)")
    if a.device == "cpu" and a.gpu_mem_fraction is not None:
        raise L.Failure("--gpu-mem-fraction needs --device cuda (with --device cpu no worker "
                        "uses a GPU)")
    for arg in a.sbatch_arg:
        if not arg.startswith("-"):
            raise L.Failure("--sbatch-arg %r is not an sbatch option (write it as "
                            "--sbatch-arg=--qos=high)" % arg)
        for own in ("--nodes", "-N", "--job-name", "-J", "--output", "-o", "--error", "-e",
                    "--partition", "-p", "--time", "-t", "--account", "-A"):
            if arg == own or arg.startswith(own + "=") or (len(own) == 2 and arg.startswith(own)
                                                         and not arg.startswith("--")):
                raise L.Failure("--sbatch-arg %s: set that with kdn-launch's own flag "
                                "(the job script sets it)" % arg)


# ------------------------------------------------------------------ script


SCRIPT_BODY = r'''
set -uo pipefail

# Where the job finds everything: paths on storage every node sees.
RUN=%(run)s
BIN=%(bin)s
MODEL=%(model)s
READY_TIMEOUT=%(ready_timeout)d  # seconds for each role to print its endpoint
STOP_WAIT=%(stop_wait)d  # seconds for each group of roles to stop
GPUS_PER_WORKER=%(gpus)d  # GPUs of each worker
NODE_GPUS=%(node_gpus)d  # GPUs the job holds on each node
GPU_GRES=%(gres)s

mkdir -p "$RUN/logs" "$RUN/pids"
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))

# The IPv4 address of node $1 (an index into nodes): its Slurm NodeAddr,
# resolved. %(listen_note)s
node_addr() {
  local a
  a=$(scontrol show node "${nodes[$1]}" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
  getent ahostsv4 "$a" | awk 'NR == 1 { print $1 }'
}
addrs=()
for i in "${!nodes[@]}"; do
  addrs[$i]=$(node_addr "$i")
  if [ -z "${addrs[$i]}" ]; then
    echo "kdn: cannot resolve the address of node ${nodes[$i]}" >&2
    exit 1
  fi
done
listen() { %(listen_fn)s; }

# What each step's task runs on its node: records "NODE PID" in $RUN/pids/,
# reports the node's name as its host (KDN_HOST_ID; that is how kvbus tells a
# peer on this node, reached through shared memory, from one on another,
# reached over tcp), keeps its own GPUS_PER_WORKER of the node's GPUs (GPU
# slot $2; -1: none; keep: CUDA_VISIBLE_DEVICES as it is), then becomes the
# kdn program.
step_main() {
  local pidfile=$1 slot=$2 all
  shift 2
  echo "$SLURMD_NODENAME $$" > "$pidfile"
  export KDN_HOST_ID=$SLURMD_NODENAME
  if [ "$slot" = keep ]; then
    :  # the job holds no GPUs: leave the environment as the site sets it
  elif [ "$slot" -lt 0 ]; then
    export CUDA_VISIBLE_DEVICES=  # router and kdn-store compute nothing on a GPU
  else
    IFS=, read -ra all <<< "${CUDA_VISIBLE_DEVICES:-}"
    if [ ${#all[@]} -lt $(((slot + 1) * GPUS_PER_WORKER)) ]; then
      echo "kdn: GPU slot $slot needs $(((slot + 1) * GPUS_PER_WORKER)) GPUs; the step sees '${CUDA_VISIBLE_DEVICES:-}'" >&2
      exit 1
    fi
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${all[*]:slot * GPUS_PER_WORKER:GPUS_PER_WORKER}")
    export CUDA_VISIBLE_DEVICES
  fi
  exec "$@"
}
export -f step_main
export GPUS_PER_WORKER

# start NAME NODE SLOT COMMAND...: COMMAND as a one-task step on node NODE.
# Steps share their node (--overlap), so a worker's step asks for all of the
# job's GPUs there and step_main keeps the worker's slot of them: Slurm 22.05
# gives overlapping steps the same GPUs when each asks for its own.
declare -A step_pid=()
start() {
  local name=$1 node=$2 slot=$3
  shift 3
  local gres=()
  if [ "$NODE_GPUS" -gt 0 ] && [ "$slot" -ge 0 ]; then gres=(--gres="gpu:${GPU_GRES}${NODE_GPUS}"); fi
  [ "$NODE_GPUS" -gt 0 ] || slot=keep
  rm -f "$RUN/logs/$name.out" "$RUN/pids/$name"
  # setsid: a signal to the job script (kdn-launch slurm down) must not reach
  # srun, which would kill its step at once instead of stopping it in order.
  setsid srun --nodes=1 --ntasks=1 --overlap --nodelist="${nodes[$node]}" --job-name="$name" \
         --kill-on-bad-exit=0 "${gres[@]}" \
         --output="$RUN/logs/$name.out" --error="$RUN/logs/$name.log" \
         bash -c 'step_main "$@"' step_main "$RUN/pids/$name" "$slot" "$@" &
  step_pid[$name]=$!
}

# endpoint NAME SCHEME: waits for the first stdout line of step NAME (its
# endpoint) and prints it. If the step ends first, prints something else or
# takes more than READY_TIMEOUT, says so with the end of the step's log and
# returns 1 (the caller then stops the job: `|| abort`).
endpoint() {
  local name=$1 scheme=$2 waited=0 line why=""
  while :; do
    if [ -f "$RUN/logs/$name.out" ] && [ "$(head -c 4096 "$RUN/logs/$name.out" | wc -l)" -ge 1 ]; then
      line=$(head -n 1 "$RUN/logs/$name.out")
      case "$line" in
        "$scheme"*) echo "$line"; return 0 ;;
      esac
      why="printed '$line' as its first line, not an endpoint"
    elif ! kill -0 "${step_pid[$name]}" 2>/dev/null; then
      why="ended before it printed its endpoint"
    elif [ "$waited" -ge $((READY_TIMEOUT * 10)) ]; then
      why="printed no endpoint within ${READY_TIMEOUT} s"
    fi
    if [ -n "$why" ]; then
      echo "kdn: $name $why; the end of its log ($RUN/logs/$name.log):" >&2
      tail -n 20 "$RUN/logs/$name.log" 2>/dev/null | sed 's/^/  | /' >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

abort() { stop; echo "kdn: the deployment did not start" >&2; exit 1; }

# stop: the router first (no new requests), then the workers, then kdn-store,
# as `kdn-launch down` does. SIGTERM goes to each step's task through
# `scancel --signal` (srun itself answers SIGTERM with SIGKILL); Slurm's
# KillWait ends a task that ignores it.
stop() {
  trap '' TERM INT
  local group name id waited live alive steps
  steps=$(squeue --steps --noheader --jobs "$SLURM_JOB_ID" --format "%%j %%i" 2>/dev/null)
  for group in "router" "prefill decode" "store"; do
    live=()
    for name in "${!step_pid[@]}"; do
      case " $group " in *" ${name%%%%-*} "*) ;; *) continue ;; esac
      kill -0 "${step_pid[$name]}" 2>/dev/null || continue
      live+=("$name")
      id=$(awk -v n="$name" '$1 == n { print $2 }' <<< "$steps")
      # (Slurm 22.05 may report an error here although the signal went out.)
      [ -z "$id" ] || scancel --signal=TERM "$id" 2>/dev/null
    done
    # Up to STOP_WAIT seconds for the group, then the next one regardless.
    for ((waited = 0; waited < STOP_WAIT * 10; waited++)); do
      alive=0
      for name in "${live[@]}"; do kill -0 "${step_pid[$name]}" 2>/dev/null && alive=1; done
      [ "$alive" = 1 ] || break
      sleep 0.1
    done
  done
}
trap 'echo "kdn: stopping (signal)" >&2; stop; exit 0' TERM INT

'''


def script_text(L, a, bin_dir, model, run_dir):
    q = shlex.quote
    plan = placement(a.prefill, a.decode, a.nodes)
    per_node = [sum(1 for _, _, n in plan if n == i) for i in range(a.nodes)]
    lines = ["#!/bin/bash",
             "# A kdn deployment as one Slurm job, written by `kdn-launch slurm submit`",
             "# (docs/slurm.md). Submit it again with: sbatch %s" % q(str(run_dir / SBATCH_NAME)),
             "#",
             "# Placement: kdn-router%s on %s;" % (" and kdn-store" if a.store else "",
                                                  "node 0"),
             "#   " + ", ".join("%s on node %d" % (n, i) for n, _, i in plan) + "."]
    lines.append("#SBATCH --job-name=%s" % JOB_NAME)
    lines.append("#SBATCH --nodes=%d" % a.nodes)
    lines.append("#SBATCH --ntasks-per-node=1")
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

    multi = a.nodes > 1
    listen_fn = ('echo "tcp://${addrs[$1]}:0"' if multi else 'echo "tcp://127.0.0.1:0"')
    listen_note = ("The job spans nodes, so workers and kdn-store listen on their node's\n"
                   "# address (docs/slurm.md says what protects these ports)." if multi else
                   "One node: workers and kdn-store listen on loopback; only the router's\n"
                   "# HTTP port is on the node's address.")
    body = SCRIPT_BODY % {
        "run": q(str(run_dir)), "bin": q(str(bin_dir)), "model": q(str(model)),
        "ready_timeout": int(a.ready_timeout), "stop_wait": int(L.STOP_WAIT_S), "gpus": a.gpus_per_worker,
        "node_gpus": a.gpus_per_worker * max(per_node),
        "gres": q(a.gpu_type + ":" if a.gpu_type else ""),
        "listen_fn": listen_fn, "listen_note": listen_note,
    }
    out = "\n".join(lines) + "\n" + body

    log = " ".join(q(f) for f in L.log_flags(a))
    worker = ['--model "$MODEL"', "--host-mib %g" % a.host_mib,
              "--chunk-tokens %d" % a.chunk_tokens, "--threads %d" % a.threads,
              "--kv-transport %s" % a.kv_transport] + ([log] if log else [])
    # Every step reads the deployment's CURVE key from the run folder (which
    # every node sees): its sockets are open to the job's steps only.
    curve = "--curve-keys %s" % q(str(a.curve_keys[0]))
    worker.append(curve)
    if a.device == "cuda":
        # step_main leaves each worker only its own GPUs in CUDA_VISIBLE_DEVICES,
        # so its first one is cuda:0, and no other worker shares it.
        worker.append("--device cuda:0 --gpu-mem-fraction %r"
                      % (a.gpu_mem_fraction if a.gpu_mem_fraction is not None else L.GPU_SHARE))
    steps = []
    if a.store:
        steps += ["# kdn-store on node 0; every worker reads and fills it.",
                  'start store 0 -1 "$BIN/kdn-store" --listen "$(listen 0)" --host-mib %g%s %s'
                  % (a.store_host_mib, " " + log if log else "", curve),
                  'STORE=$(endpoint store tcp://) || abort', ""]
        worker.append('--store "$STORE" --store-codec %s' % a.store_codec)
    steps += ["# The workers, dealt over the nodes in order, each with these flags.",
              "WORKER=(%s)" % " ".join(worker)]
    slots = [0] * a.nodes
    for name, role, node in plan:
        extra = (' --kvbus-listen "$(listen %d)"' % node) if role == "decode" else ""
        steps.append('start %s %d %d "$BIN/kdn-%s" "${WORKER[@]}" --listen "$(listen %d)"%s '
                     '--name %s' % (name, node, slots[node], role, node, extra, name))
        slots[node] += 1
    steps.append("")
    for role in ("prefill", "decode"):
        names = [n for n, r, _ in plan if r == role]
        steps.append("%s=%s" % (role.upper(), '""'))
        for n in names:
            steps.append('%s="$%s${%s:+,}$(endpoint %s tcp://)" || abort'
                         % (role.upper(), role.upper(), role.upper(), n))
    router = ['"$BIN/kdn-router"', '--model "$MODEL"', '--prefill "$PREFILL"',
              '--decode "$DECODE"', '--host %s' % (q(a.host) if a.host else '"${addrs[0]}"'),
              "--port %d" % a.port, "--recompute-ratio %r" % a.recompute_ratio,
              "--curve-keys %s" % q(str(a.curve_keys[1]))] + (
                  [log] if log else [])
    if a.separator:
        router.append("--separator %s" % q(a.separator))
    if a.max_queued != 1024:
        router.append("--max-queued %d" % a.max_queued)
    if a.max_connections != 1024:
        router.append("--max-connections %d" % a.max_connections)
    if getattr(a, "max_body_buffer_mib", 256) != 256:
        router.append("--max-body-buffer-mib %d" % a.max_body_buffer_mib)
    if a.no_resume:
        router.append("--no-resume")
    if a.api_keys:
        router.append("--api-keys %s" % q(str(Path(a.api_keys).resolve())))
    steps += ["",
              "# The router on node 0, with the workers' endpoints; its first stdout line",
              "# is its URL, which `kdn-launch slurm status` reads from logs/router.out.",
              "start router 0 -1 " + " ".join(router),
              'URL=$(endpoint router http://) || abort',
              'echo "kdn: serving on $URL"',
              "",
              "# Serve until scancel or the time limit; a step that ends is reported by",
              "# `kdn-launch slurm status`, and the router stops sending it work.",
              "while [ -n \"$(jobs -pr)\" ]; do wait -n; done",
              'echo "kdn: every step has ended"', ""]
    return out + "\n".join(steps)


# ------------------------------------------------------------------ commands


def record_path(run_dir):
    return Path(run_dir) / RECORD_NAME


def read_record(L, run_dir):
    try:
        return json.loads(record_path(run_dir).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise L.Failure("cannot read %s: %s" % (record_path(run_dir), e))


def job_state(L, job_id):
    """(state, reason, node list) of the job; state "GONE" when Slurm has
    forgotten it (it ended more than MinJobAge ago)."""
    info = job_info(L, job_id)
    if info is None:
        return "GONE", "", ""
    return info.get("JobState", "UNKNOWN"), info.get("Reason", ""), info.get("NodeList", "")


def first_line(path):
    try:
        with open(path, errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    return text.split("\n", 1)[0].strip() if "\n" in text else None


def cmd_submit(L, a):
    check_flags(L, a)
    bin_dir = Path(a.bin_dir).resolve() if a.bin_dir else L.bin_dir_from_env()
    L.require_bins(bin_dir, ["kdn-prefill", "kdn-decode", "kdn-router", "kdn-keygen"] +
                   (["kdn-store"] if a.store else []))
    require_tools(L, ("sbatch", "squeue", "scontrol", "scancel"))
    run_dir = Path(a.run_dir).resolve()
    old = read_record(L, run_dir)
    if old is not None:
        state, _, _ = job_state(L, old["job_id"])
        if state in LIVE_STATES:
            raise L.Failure("%s already holds job %s (%s); `kdn-launch slurm down %s` first, "
                            "or pick another --run-dir" % (run_dir, old["job_id"], state,
                                                           old["job_id"]))
    model = L.resolve_model(a, bin_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "pids"):
        d = run_dir / sub
        if d.is_dir():
            for f in d.iterdir():
                if f.is_file():
                    f.unlink()
        d.mkdir(exist_ok=True)
    a.curve_keys = L.make_curve_keys(bin_dir, run_dir)
    script = run_dir / SBATCH_NAME
    script.write_text(script_text(L, a, bin_dir, model, run_dir))
    script.chmod(0o755)
    _, out, _ = slurm(L, ["sbatch", "--parsable", str(script)])
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise L.Failure("sbatch printed %r, not a job id" % out.strip())
    record = {"job_id": job_id, "run_dir": str(run_dir), "script": str(script),
              "model": str(model), "nodes": a.nodes, "submitted": int(time.time()),
              "roles": ([{"name": "store", "role": "store", "node": 0}] if a.store else []) +
                       [{"name": n, "role": r, "node": i} for n, r, i in placement(
                           a.prefill, a.decode, a.nodes)] +
                       [{"name": "router", "role": "router", "node": 0}]}
    L.write_json(record_path(run_dir), record)
    L.info("submitted %s as job %s (logs in %s)" % (script, job_id, run_dir / "logs"))
    print(job_id, flush=True)
    if not a.wait:
        return 0
    url = wait_ready(L, job_id, run_dir, a.ready_timeout)
    print("kdn: serving on %s" % url, flush=True)
    return 0


def wait_ready(L, job_id, run_dir, timeout):
    """Waits until the job's router answers /health 200; returns its URL. A job
    that ends first, or a timeout, is a Failure with what Slurm and the logs say."""
    deadline = time.monotonic() + timeout
    next_note = 0.0
    last = ""
    while True:
        state, reason, nodes = job_state(L, job_id)
        if state not in LIVE_STATES:
            raise L.Failure("job %s ended (%s%s) before the deployment served; %s"
                            % (job_id, state, ", " + reason if reason and reason != "None" else "",
                               failure_logs(L, run_dir)))
        url = None
        if state == "RUNNING":
            line = first_line(run_dir / "logs" / "router.out")
            if line and line.startswith("http://"):
                url = line.rstrip("/")
                status, body = L.http_get(url + "/health", timeout=2.0)
                if status == 200:
                    return url
                last = "%s/health: %s %s" % (url, status or "no answer", body.strip()[:200])
            else:
                last = "starting on %s" % nodes
        else:
            last = "%s (%s)" % (state, reason)
        now = time.monotonic()
        if now > deadline:
            raise L.Failure("job %s is not serving after %.0f s (%s); it stays queued or "
                            "running: `kdn-launch slurm status %s` shows it, `kdn-launch "
                            "slurm down %s` cancels it" % (job_id, timeout, last, job_id, job_id))
        if now >= next_note:
            L.info("waiting for job %s: %s" % (job_id, last))
            next_note = now + 3.0
        time.sleep(0.3)


def failure_logs(L, run_dir):
    job_out = run_dir / "logs" / "job.out"
    return "the end of %s:\n%s" % (job_out, L.log_tail(job_out))


def find_run_dir(L, a, job_id):
    """The run dir of job_id: --run-dir if given, else the folder of the job's
    script (scontrol's Command)."""
    if a.run_dir:
        run_dir = Path(a.run_dir).resolve()
    else:
        info = job_info(L, job_id)
        if info is None or not info.get("Command"):
            raise L.Failure("Slurm no longer knows job %s; name its folder with --run-dir"
                            % job_id)
        run_dir = Path(info["Command"]).parent
    rec = read_record(L, run_dir)
    if rec is None:
        raise L.Failure("%s has no %s: not a folder of `kdn-launch slurm submit`"
                        % (run_dir, RECORD_NAME))
    if str(rec.get("job_id")) != str(job_id):
        raise L.Failure("%s holds job %s, not %s" % (run_dir, rec.get("job_id"), job_id))
    return run_dir, rec


def cmd_status(L, a):
    job_id = str(a.job_id)
    run_dir, rec = find_run_dir(L, a, job_id)
    state, reason, nodes = job_state(L, job_id)
    print("job %s: %s%s%s" % (job_id, state,
                              " (%s)" % reason if reason and reason != "None" else "",
                              " on %s" % nodes if nodes and nodes != "(null)" else ""))
    running = running_steps(L, job_id) if state in LIVE_STATES else {}
    url = first_line(run_dir / "logs" / "router.out")
    health, body = None, None
    if url and url.startswith("http://") and state == "RUNNING":
        status, text = L.http_get(url.rstrip("/") + "/health")
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


def cmd_down(L, a):
    job_id = str(a.job_id)
    run_dir, _ = find_run_dir(L, a, job_id)
    state, _, _ = job_state(L, job_id)
    if state not in LIVE_STATES:
        print("job %s is not running (%s)" % (job_id, state))
        return 0
    if state == "RUNNING":
        # The job script stops its steps in order on SIGTERM (router, workers,
        # store); only its shell is signalled.
        L.info("asking job %s to stop its steps (router, workers, store)" % job_id)
        slurm(L, ["scancel", "--batch", "--signal=TERM", job_id], check=False)
        if wait_gone(L, job_id, DOWN_WAIT_S):
            print("stopped job %s" % job_id)
            return 0
        L.info("job %s did not end within %.0f s: scancel" % (job_id, DOWN_WAIT_S))
    slurm(L, ["scancel", job_id])
    if not wait_gone(L, job_id, DOWN_WAIT_S * 2):
        raise L.Failure("job %s still %s after scancel" % (job_id, job_state(L, job_id)[0]))
    print("stopped job %s" % job_id)
    return 0


def wait_gone(L, job_id, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_state(L, job_id)[0] not in LIVE_STATES:
            return True
        time.sleep(0.3)
    return False


# ------------------------------------------------------------------ flags


def add_commands(L, sub):
    sl = sub.add_parser(
        "slurm", help="run the deployment as a Slurm job (submit, status, down)",
        description="The deployment as one Slurm job (docs/slurm.md): `submit` writes "
        "RUN_DIR/kdn.sbatch and submits it, `status JOBID` shows it, `down JOBID` stops it. "
        "RUN_DIR must be on storage every node of the job sees.")
    ssub = sl.add_subparsers(dest="slurm_command", metavar="COMMAND", parser_class=L.Parser)
    sl.set_defaults(func=lambda args: sl.error("a command is required: submit, status or down"))

    sb = ssub.add_parser(
        "submit", help="write the job script and sbatch it",
        description="Write RUN_DIR/kdn.sbatch (kdn-router, and kdn-store with --store, on the "
        "job's first node; workers dealt over the nodes in order, prefill first), submit it "
        "with sbatch, and print the job id on stdout. With --wait, also wait until the "
        "router answers /health and print 'kdn: serving on URL'. Logs: RUN_DIR/logs/NAME.log "
        "(stderr), NAME.out (stdout), job.out (the job script).")
    L.add_up_flags(sb, run_dir_default=str(L.REPO / ".kdn-slurm"), port_default=0,
                   host_default=None, run_dir_help="folder of kdn.sbatch, slurm.json, logs/ and "
                   "pids/, on storage every node sees (default: %(default)s)",
                   host_help="router HTTP address (default: the first node's address)")
    sb.add_argument("--nodes", type=L.positive_int, default=1, metavar="N",
                    help="nodes of the job (default: %(default)s); at most one per worker")
    sb.add_argument("--partition", metavar="NAME", help="sbatch --partition")
    sb.add_argument("--time", metavar="LIMIT", help="sbatch --time (e.g. 2:00:00)")
    sb.add_argument("--account", metavar="NAME", help="sbatch --account")
    sb.add_argument("--gpus-per-worker", type=L.nonneg_int, default=0, metavar="G",
                    help="GPUs of each worker: the job asks each node for the GPUs of the "
                    "workers placed on it (sbatch --gres=gpu:N) and each worker gets its own "
                    "G of them in CUDA_VISIBLE_DEVICES (default: %(default)s)")
    sb.add_argument("--gpu-type", default="", metavar="TYPE",
                    help="GPU type in the gres request (gpu:TYPE:G), as the cluster names it")
    sb.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the workers' engines run: cpu, or cuda (needs "
                    "--gpus-per-worker): each worker gets --device cuda:0, the first of its own "
                    "GPUs; with cpu no --device flag is passed (default: %(default)s)")
    sb.add_argument("--gpu-mem-fraction", type=L.mem_fraction, metavar="F",
                    help="with --device cuda: the share of its GPU's memory each worker may "
                    "take (kdn-prefill/kdn-decode --gpu-mem-fraction; default: %g, as no two "
                    "workers share a GPU)" % L.GPU_SHARE)
    sb.add_argument("--no-exclusive", dest="exclusive", action="store_false",
                    help="do not ask for whole nodes (sbatch --exclusive is the default: "
                    "workers use every core of their node)")
    sb.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                    help="one more sbatch option, as --sbatch-arg=--qos=high (repeatable)")
    sb.add_argument("--wait", action="store_true",
                    help="wait (up to --ready-timeout) until the router answers /health, "
                    "then print its URL")
    sb.set_defaults(func=lambda args: cmd_submit(L, args))

    st = ssub.add_parser(
        "status", help="show the job, each role's node, pid and health",
        description="Print the job's state, then each role: its node, pid, whether its srun "
        "step runs, its health as the router sees it, and its endpoint; then the router's "
        "URL. Exit code 0 when the job runs and every role is up and healthy, 1 otherwise.")
    st.add_argument("job_id", metavar="JOBID", type=L.positive_int)
    st.add_argument("--run-dir", metavar="DIR",
                    help="the job's folder (default: the folder of its script, from scontrol)")
    st.set_defaults(func=lambda args: cmd_status(L, args))

    dn = ssub.add_parser(
        "down", help="stop the job cleanly (scancel)",
        description="Signal the job script, which stops the router, then the workers, then "
        "kdn-store; if the job has not ended within %.0f s, scancel it." % DOWN_WAIT_S)
    dn.add_argument("job_id", metavar="JOBID", type=L.positive_int)
    dn.add_argument("--run-dir", metavar="DIR",
                    help="the job's folder (default: the folder of its script, from scontrol)")
    dn.set_defaults(func=lambda args: cmd_down(L, args))
    return sl
