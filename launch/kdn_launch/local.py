"""`up`, `down`, `status` and `--dry-run`: a deployment on this machine. The
launcher starts the processes in dependency order (store or Redis Cluster,
workers, router),
each in its own session with its stdout and stderr in files under the run
folder, waits for each one's endpoint line and then for the router's
/health, and records what it started in RUN_DIR/deployment.json (the
deployment record) so that `down` and `status` find it."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from . import argv, redis_cluster
from .plan import (bin_dir_from_env, check_model, curve_key_paths, make_curve_keys,
                   plan_devices, remove_curve_keys, require_bins, resolve_model, worker_names)
from .procs import STOP_WAIT_S, Proc, SignalGuard, pid_alive, stop_all
from .util import REPO, Failure, Interrupted, http_get, info, log_tail, write_json

RUN_DIR = REPO / ".kdn-run"
LOCAL_LISTEN = "tcp://127.0.0.1:0"


# ------------------------------------------------------------ command lines


def store_command(a, bin_dir):
    return argv.store_argv(a, bin_dir, LOCAL_LISTEN)


def kv_events_flags(a, k):
    """The k-th worker's (in start order) --kv-events flags with
    --kv-events-port; none without it."""
    port = getattr(a, "kv_events_port", None)
    if port is None:
        return []
    last = port + 2 * (a.prefill + a.decode) - 1
    if port == 0 or last > 65535:
        raise Failure("--kv-events-port %d: the workers' event ports would run from %d to %d, "
                      "outside 1-65535" % (port, port, last))
    return ["--kv-events", "tcp://127.0.0.1:%d" % (port + 2 * k),
            "--kv-events-replay", "tcp://127.0.0.1:%d" % (port + 2 * k + 1)]


def worker_commands(a, bin_dir, model, store_ep, devices, redis_url=None,
                    redis_password_file=None):
    """[(name, role, cmd)] of the workers, in start order."""
    return [(name, role, argv.worker_argv(a, bin_dir, model, name, role, LOCAL_LISTEN, store_ep,
                                          devices[name], redis_url, redis_password_file) +
             kv_events_flags(a, k))
            for k, (name, role) in enumerate(worker_names(a.prefill, a.decode))]


def router_names(a):
    """[(name, port)] of the routers: "router" on --port, then "router-1",
    ... on the ports after it (each on a free port of its own with --port 0)."""
    n = getattr(a, "routers", 1)
    if a.port and a.port + n - 1 > 65535:
        raise Failure("--port %d --routers %d: the routers' ports would run past 65535"
                      % (a.port, n))
    return [("router" if i == 0 else "router-%d" % i, a.port + i if a.port else 0)
            for i in range(n)]


def router_commands(a, bin_dir, model, prefill_eps, decode_eps):
    """[(name, cmd)] of the routers, each over every worker."""
    more = []
    if getattr(a, "lookups_from_events", False):
        if getattr(a, "kv_events_port", None) is None:
            raise Failure("--lookups-from-events needs --kv-events-port: the routers follow "
                          "the workers' KV events, which only --kv-events-port publishes")
        more = ["--lookups-from-events"]
    return [(name, argv.router_argv(a, bin_dir, model, ",".join(prefill_eps),
                                    ",".join(decode_eps), a.host, port) + more)
            for name, port in router_names(a)]


def print_plan(a, bin_dir, model, devices):
    """--dry-run: each process's command line, one per line ("NAME: COMMAND"),
    in start order; an endpoint known only once its process serves is written
    NAME-ENDPOINT."""
    store_ep = "store-ENDPOINT" if a.store else None
    if a.store:
        print("store: " + shlex.join(store_command(a, bin_dir)))
    redis_url, password_file = a.kdn_redis, getattr(a, "kdn_redis_password_file", None)
    if a.redis_cluster:
        # Its nodes read everything from their redis.conf; the password is
        # made when the cluster starts.
        cluster = redis_cluster.RedisCluster(a.run_dir, a.redis_cluster)
        server = shutil.which("redis-server") or "redis-server"
        for node in cluster.nodes:
            print("%s: %s" % (node.name, shlex.join([server, str(node.conf)])))
        redis_url = redis_cluster.url(None, ["%s-ENDPOINT" % n.name
                                             for n in cluster.nodes[:a.redis_cluster]])
        password_file = str(redis_cluster.password_path(a.run_dir))
    workers = worker_commands(a, bin_dir, model, store_ep, devices, redis_url, password_file)
    for name, _, cmd in workers:
        print("%s: %s" % (name, shlex.join(cmd)))
    eps = {role: [name + "-ENDPOINT" for name, r, _ in workers if r == role]
           for role in ("prefill", "decode")}
    for name, cmd in router_commands(a, bin_dir, model, eps["prefill"], eps["decode"]):
        print("%s: %s" % (name, shlex.join(cmd)))


# ------------------------------------------------------- deployment record


def deployment_path(run_dir):
    return Path(run_dir) / "deployment.json"


def read_deployment(run_dir):
    path = deployment_path(run_dir)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Failure("cannot read %s: %s" % (path, e))



def write_deployment(run_dir, dep):
    write_json(deployment_path(run_dir), dep)


def remove_deployment(run_dir):
    try:
        deployment_path(run_dir).unlink()
    except FileNotFoundError:
        pass


def forget(run_dir):
    """After a deployment stopped: its record, its CURVE keys and its Redis
    password go (the logs stay)."""
    remove_deployment(run_dir)
    remove_curve_keys(run_dir)
    redis_cluster.remove_secrets(run_dir)


class Deployment:
    """What `up` starts: the processes and the file that names them."""

    def __init__(self, args, bin_dir, model, devices):
        self.args = args
        self.bin_dir = bin_dir
        self.model = model
        self.devices = devices  # {worker name: WorkerDevice}, from plan_devices
        self.run_dir = Path(args.run_dir)
        self.procs = []
        self.url = None   # the first router's
        self.urls = []    # every router's, the first first
        self.started = time.time()
        self.env = dict(os.environ)
        # Idle OpenMP threads spin briefly, then sleep: long enough to bridge
        # the hundreds of parallel regions of one forward pass (sleeping at
        # each, OMP_WAIT_POLICY=PASSIVE, made a decode step about 3x
        # slower), short enough (about 0.2 ms) that an idle worker leaves
        # the cores to the other workers of this machine.
        if "OMP_WAIT_POLICY" not in self.env and "GOMP_SPINCOUNT" not in self.env:
            self.env["GOMP_SPINCOUNT"] = "3000"

    def save(self, launcher_pid):
        write_deployment(self.run_dir, {
            "url": self.url, "urls": self.urls, "model": str(self.model),
            "processes": [p.to_json() for p in self.procs],
            "started": int(self.started), "launcher_pid": launcher_pid,
        })

    def record(self, p):
        """Adds `p`, a process started elsewhere (a Redis node), to the record."""
        self.procs.append(p)
        self.save(os.getpid())

    def start(self, name, role, cmd, device=None):
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out_path, log_path = logs / (name + ".out"), logs / (name + ".log")
        with open(out_path, "wb") as out, open(log_path, "wb") as err:
            # A session of its own: a Ctrl-C in the terminal reaches only the
            # launcher, which stops the deployment in order.
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                     env=self.env, start_new_session=True)
        p = Proc(name, role, cmd, self.run_dir, popen=popen, device=device)
        self.procs.append(p)
        self.save(os.getpid())
        return p

    def wait_endpoint(self, p, scheme, timeout):
        """The first stdout line of `p`: its endpoint (or the router's URL)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(p.out, errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            if "\n" in text:
                line = text.split("\n", 1)[0].strip()
                if not line.startswith(scheme):
                    raise Failure("%s printed %r as its first line, not an endpoint (%s...); "
                                  "its log (%s):\n%s" % (p.name, line, scheme, p.log, log_tail(p.log)))
                p.endpoint = line
                self.save(os.getpid())
                return line
            if not p.alive():
                raise Failure("%s %s before serving; the end of its log (%s):\n%s"
                              % (p.name, p.exit_text(), p.log, log_tail(p.log)))
            if time.monotonic() > deadline:
                raise Failure("%s printed no endpoint within %.0f s; the end of its log (%s):\n%s"
                              % (p.name, timeout, p.log, log_tail(p.log)))
            time.sleep(0.05)

    def up(self):
        a, b = self.args, self.bin_dir
        store_ep, redis_url = None, a.kdn_redis
        password_file = getattr(a, "kdn_redis_password_file", None)
        if a.store:
            p = self.start("store", "store", store_command(a, b))
            info("started kdn-store (pid %d)" % p.pid)
            store_ep = self.wait_endpoint(p, "tcp://", a.ready_timeout)
        if a.redis_cluster:
            cluster = redis_cluster.start_cluster(
                self.run_dir, a.redis_cluster, a.redis_maxmemory_mib, a.redis_node_timeout_ms,
                a.ready_timeout, on_start=self.record)
            self.save(os.getpid())  # the nodes' endpoints
            info("Redis Cluster up: %d primaries (%s) with a replica each; password in %s"
                 % (a.redis_cluster, ", ".join(cluster.seeds()),
                    redis_cluster.password_path(self.run_dir)))
            redis_url = cluster.worker_url()
            password_file = str(redis_cluster.password_path(self.run_dir))
        if a.device != "cpu":
            info("GPUs: " + ", ".join("%s on %s" % (name, d.describe())
                                      for name, d in self.devices.items()))
        workers = [self.start(name, role, cmd, self.devices[name])
                   for name, role, cmd in worker_commands(a, b, self.model, store_ep, self.devices,
                                                          redis_url, password_file)]
        info("started %d prefill and %d decode workers; loading %s" % (a.prefill, a.decode, self.model))
        for p in workers:
            self.wait_endpoint(p, "tcp://", a.ready_timeout)
            info("%s serves on %s (pid %d%s%s)" % (
                p.name, p.endpoint, p.pid, "" if a.device == "cpu" else ", " + p.device.name,
                model_load_note(p.log)))
        routers = [self.start(name, "router", cmd) for name, cmd in router_commands(
            a, b, self.model, [p.endpoint for p in workers if p.role == "prefill"],
            [p.endpoint for p in workers if p.role == "decode"])]
        for router in routers:
            self.urls.append(self.wait_endpoint(router, "http://", a.ready_timeout).rstrip("/"))
            self.url = self.urls[0]
            self.save(os.getpid())
        for url in self.urls:
            self.wait_healthy(url, a.ready_timeout)

    def wait_healthy(self, url, timeout):
        deadline = time.monotonic() + timeout
        next_note = 0.0
        while True:
            status, body = http_get(url + "/health", timeout=2.0)
            if status == 200:
                return
            for p in self.procs:
                if not p.alive():
                    raise Failure("%s %s while the deployment started; the end of its log (%s):\n%s"
                                  % (p.name, p.exit_text(), p.log, log_tail(p.log)))
            now = time.monotonic()
            if now > deadline:
                raise Failure("%s/health did not answer 200 within %.0f s (last: %s %s)"
                              % (url, timeout, status or "no answer", body.strip()[:300]))
            if now >= next_note:
                info("waiting for workers... (%s/health: %s %s)"
                     % (url, status or "no answer", body.strip()[:200]))
                next_note = now + 3.0
            time.sleep(0.2)

    def check_children(self):
        """Reports each child that died since the last call."""
        for p in self.procs:
            if not p.reported_dead and not p.alive():
                p.reported_dead = True
                info("%s (pid %d) %s unexpectedly; the end of its log (%s):\n%s"
                     % (p.name, p.pid, p.exit_text(), p.log, log_tail(p.log)))



def model_load_note(log):
    """"; model loaded in T s (ENGINE)" from a worker's log, or ""."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return ""
    m = re.search(r"model \S+ loaded in ([0-9.]+) s \(([^)]*)\)", text)
    return "; model loaded in %s s: %s" % (m.group(1), m.group(2)) if m else ""


# ------------------------------------------------------------------ commands


def running_procs(run_dir):
    """(deployment dict, Procs) of run_dir/deployment.json, or (None, [])."""
    dep = read_deployment(run_dir)
    if dep is None:
        return None, []
    return dep, [Proc.from_json(d, run_dir) for d in dep.get("processes", [])]



def dry_run(args):
    """--dry-run of `up` and `demo`: checks the flags, prints the commands,
    starts nothing."""
    devices = plan_devices(args)
    bin_dir = Path(args.bin_dir).resolve() if args.bin_dir else bin_dir_from_env()
    if not args.no_curve:
        args.curve_keys = curve_key_paths(args.run_dir)
    print_plan(args, bin_dir, resolve_model(args, bin_dir, make=False), devices)
    return 0


def start_deployment(args):
    """Starts a deployment as `up` and `demo` do. Returns (Deployment, guard);
    on failure or a signal, stops what it started and raises."""
    devices = plan_devices(args)
    if args.model is not None:
        check_model(args.model)
    bin_dir = Path(args.bin_dir).resolve() if args.bin_dir else bin_dir_from_env()
    require_bins(bin_dir, ["kdn-prefill", "kdn-decode", "kdn-router"] +
                 (["kdn-store"] if args.store else []) + ([] if args.no_curve else ["kdn-keygen"]))
    if args.redis_cluster:
        redis_cluster.require_redis()
    run_dir = Path(args.run_dir)
    dep, procs = running_procs(run_dir)
    if dep is not None:
        alive = [p for p in procs if p.alive()]
        if alive:
            raise Failure("already up (%s, run dir %s); `kdn-launch down` first"
                          % (", ".join("%s pid %d" % (p.name, p.pid) for p in alive), run_dir))
        info("removing the stale %s (its processes are gone)" % deployment_path(run_dir))
        remove_deployment(run_dir)
    model = resolve_model(args, bin_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.no_curve:
        info("--no-curve: internal sockets are plaintext; any local process can reach them")
    else:
        args.curve_keys = make_curve_keys(bin_dir, run_dir)
    d = Deployment(args, bin_dir, model, devices)
    guard = SignalGuard()
    try:
        d.up()
    except BaseException as e:
        guard.armed = False
        if isinstance(e, Interrupted):
            info("interrupted; stopping what was started")
        stop_all(d.procs, quiet=True)
        forget(run_dir)
        raise
    return d, guard


def print_ready(url, detached, others=()):
    for other in others:
        print("another router: %s" % other)
    print("try: curl -sN %s/v1/completions -H 'Content-Type: application/json' "
          "-d '{\"prompt\": \"Hello\", \"max_tokens\": 16, \"stream\": true}'" % url)
    print("status page: %s/ (workers, KV pools, the KDN, recent requests and errors)" % url)
    if detached:
        print("stop it with: kdn-launch down")
    else:
        print("Ctrl-C stops it")
    print("kdn: serving on %s" % url, flush=True)


def cmd_up(args):
    if args.dry_run:
        return dry_run(args)
    d, guard = start_deployment(args)
    d.save(None if args.detach else os.getpid())
    if args.detach:
        print_ready(d.url, detached=True, others=d.urls[1:])
        return 0
    print_ready(d.url, detached=False, others=d.urls[1:])
    try:
        while True:
            d.check_children()
            time.sleep(0.5)
    except Interrupted:
        pass
    info("shutting down")
    stop_all(d.procs)
    forget(d.run_dir)
    info("stopped")
    return 0


def down(run_dir):
    """Stops what run_dir/deployment.json names; False if nothing was there."""
    dep, procs = running_procs(run_dir)
    if dep is None:
        return False
    launcher = dep.get("launcher_pid")
    if launcher and launcher != os.getpid() and pid_alive(launcher):
        # A foreground `up` supervises it: let that launcher stop it in order.
        info("asking the foreground kdn-launch (pid %d) to stop the deployment" % launcher)
        os.kill(launcher, signal.SIGTERM)
        deadline = time.monotonic() + 4 * STOP_WAIT_S
        while time.monotonic() < deadline and pid_alive(launcher):
            time.sleep(0.1)
    stop_all(procs)
    forget(run_dir)
    return True


def cmd_down(args):
    if not down(Path(args.run_dir)):
        print("nothing is running (no %s)" % deployment_path(args.run_dir))
        return 0
    print("stopped")
    return 0


def cmd_status(args):
    run_dir = Path(args.run_dir)
    dep, procs = running_procs(run_dir)
    if dep is None:
        print("nothing is running (no %s)" % deployment_path(run_dir))
        return 1
    ok = True
    row = "%-12s %-8s %8s  %-6s %-8s %-8s %s"
    print(row % ("NAME", "ROLE", "PID", "STATE", "DEVICE", "GPU-MEM", "ENDPOINT"))
    for p in procs:
        alive = p.alive()
        ok = ok and alive
        device = p.device.name if p.device else "-"
        fraction = "%g" % p.device.fraction if p.device and p.device.fraction else "-"
        print(row % (p.name, p.role, p.pid, "alive" if alive else "dead", device, fraction,
                     p.endpoint or "-"))
    url = dep.get("url")
    if not url:
        print("no router URL yet (the deployment is starting or failed to start)")
        return 1
    for i, u in enumerate(dep.get("urls") or [url]):
        status, body = http_get(u + "/health")
        print("GET %s/health: %s" % (u, status or "no answer (%s)" % body))
        ok = ok and status == 200
        if status and i == 0:
            try:
                print(json.dumps(json.loads(body), indent=2))
            except ValueError:
                print(body)
    return 0 if ok else 1
