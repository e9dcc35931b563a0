"""A Redis Cluster for the workers' shared KV cache (`up --redis-cluster N`,
`slurm submit --redis-cluster`): its redis.conf, its password, and, on this
machine, its N primaries and their replicas on loopback (start_cluster).
The one way kdn starts Redis: the launcher, kdn-bench's shared-tier
workload and the tests (tests/kvbus/redis_cluster.h runs `python3 -m
kdn_launch.redis_cluster`) all start it here, one standalone node included.

Each node runs in a folder of its own, RUN_DIR/redis/NAME/, holding its
redis.conf (mode 0600: it holds the password), nodes.conf, redis.log (its
log) and redis.out (its stdout and stderr, where a config error goes). The
password is RUN_DIR/redis.password (mode 0600); the servers read it from
their redis.conf and redis-cli from $REDISCLI_AUTH, so no command line
shows it. The workers take it in their --kdn-redis URL (docs/launch.md,
"Redis Cluster").
"""

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .procs import Proc, stop_all
from .util import Failure, log_tail

PASSWORD_NAME = "redis.password"
FOLDER_NAME = "redis"
MIN_PRIMARIES = 3  # redis-cli --cluster create refuses fewer
DEFAULT_MAXMEMORY_MIB = 1024
DEFAULT_NODE_TIMEOUT_MS = 5000
CLI_TIMEOUT_S = 60.0
PORT_TRIES = 3  # starts of a node whose port another process took meanwhile
LOOPBACK = "127.0.0.1"


def require_redis():
    """The absolute paths of redis-server and redis-cli; Failure if missing."""
    paths = []
    for tool in ("redis-server", "redis-cli"):
        path = shutil.which(tool)
        if path is None:
            raise Failure("%s is not installed or not on PATH (Debian: apt-get install "
                          "redis-server)" % tool)
        paths.append(path)
    return paths


def password_path(run_dir):
    return Path(run_dir) / PASSWORD_NAME


def write_private(path, text):
    """`path` with `text`, readable by this user only (mode 0600, also when
    it existed with another mode)."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def make_password(run_dir):
    """A new password in RUN_DIR/redis.password (mode 0600); returns it."""
    password = secrets.token_hex(32)
    write_private(password_path(run_dir), password + "\n")
    return password


def remove_secrets(run_dir):
    """Removes the password file and every node's redis.conf (which hold the
    password); the logs stay."""
    paths = [password_path(run_dir)] + list((Path(run_dir) / FOLDER_NAME).glob("*/redis.conf"))
    paths += list((Path(run_dir) / FOLDER_NAME).glob("common.conf"))
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def url(password, endpoints):
    """A --kdn-redis URL: the password (None: none, the workers then read
    it from --kdn-redis-password-file), then every seed "host:port",
    comma-separated."""
    if password is None:
        return "redis://" + ",".join(endpoints)
    return "redis://:%s@%s" % (password, ",".join(endpoints))


def common_conf(password, maxmemory_mib, node_timeout_ms, cluster=True):
    """The settings every node of a cluster shares, each with its reason
    (docs/launch.md lists them too); `cluster` False: those of one
    standalone node."""
    cluster_lines = [
        "# A cluster node: slots, failover, the cluster bus.",
        "cluster-enabled yes",
        "# The node's own record of the cluster, in its folder (its dir).",
        "cluster-config-file nodes.conf",
        "# How long a node may be unreachable before its replica takes over.",
        "cluster-node-timeout %d" % node_timeout_ms,
        "# A cache: a replica takes over a failed primary however long its own",
        "# link to it was down (what it lacks is misses, not errors); by default",
        "# a replica whose initial sync had not finished would never take over.",
        "cluster-replica-validity-factor 0",
        "# A key whose shard is failing over is a miss; the other slots keep serving.",
        "cluster-require-full-coverage no",
        "# Reads keep working on a node that sees the cluster down.",
        "cluster-allow-reads-when-down yes"]
    return "\n".join([
        "# Written by kdn-launch (docs/launch.md, \"Redis Cluster\").",
    ] + (cluster_lines if cluster else []) + [
        "# A cache: a bounded size per primary (0: unbounded), evicting the least",
        "# recently used key rather than refusing writes.",
        "maxmemory %dmb" % maxmemory_mib,
        "maxmemory-policy allkeys-lru",
        "# MB-sized values make few keys per node: sampling 64 of them (Redis's",
        "# most, not 5) makes the approximated LRU the real one at no real cost",
        "# (with 10, a hot key was now and then evicted before older ones).",
        "maxmemory-samples 64",
        "# A cache: no persistence; a restarted node starts empty.",
        "save \"\"",
        "appendonly no",
        "# KV chunks are MB-sized values: the default limits would disconnect a",
        "# replica in the middle of its sync.",
        "client-output-buffer-limit replica 512mb 256mb 60",
        "repl-backlog-size 256mb",
        "# The launcher owns the process: in the foreground, with its argv kept",
        "# (the launcher tells its processes by argv[0]).",
        "daemonize no",
        "set-proc-title no",
        "# Clients and the replicas' link to their primary need the password.",
        "requirepass %s" % password,
        "masterauth %s" % password,
        ""])


def node_conf(bind, port, cluster_port, folder):
    """The settings of one node: where it listens and where its files are
    (`cluster_port` None: a standalone node)."""
    lines = ["# Only this address: loopback, or the node's own address under Slurm.",
             "bind %s" % bind,
             "port %d" % port]
    if cluster_port is not None:
        lines += ["# The cluster bus, a port of its own (the default, port + 10000, may be",
                  "# taken or past 65535).",
                  "cluster-port %d" % cluster_port]
    if bind == LOOPBACK:
        lines += ["# Bound to loopback only, and with a password: nothing to protect",
                  "# against.",
                  "protected-mode no"]
    lines += ["# Its nodes.conf and its log in its own folder.",
              "dir %s" % folder,
              "logfile %s" % (Path(folder) / "redis.log"),
              ""]
    return "\n".join(lines)


def pick_ports(count):
    """`count` distinct ports that are free on loopback now, picked by the
    OS (as it picks the workers' ports). Another process may take one before
    its node binds it; start_node then picks again."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cli(redis_cli, password, port, *args, host=LOOPBACK, timeout=10.0):
    """redis-cli ARGS against host:port with the password from the
    environment (not argv); (returncode, stdout + stderr)."""
    env = dict(os.environ, REDISCLI_AUTH=password)
    try:
        r = subprocess.run([redis_cli, "-h", host, "-p", str(port)] + list(args),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "redis-cli %s did not answer within %.0f s" % (" ".join(args), timeout)
    return r.returncode, r.stdout + r.stderr


def info_fields(text):
    """{field: value} of a `cluster info` or `info` answer."""
    fields = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.strip().split(":", 1)
            fields[k] = v
    return fields


def replica_pairs(nodes_text):
    """{primary id: [replica ids]} of a `cluster nodes` answer: the primaries
    that hold slots, each with the replicas that follow it."""
    primaries, replicas = {}, []
    for line in nodes_text.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        flags = f[2].split(",")
        if "master" in flags and len(f) > 8:
            primaries[f[0]] = []
        elif "slave" in flags:
            replicas.append((f[0], f[3]))
    for rid, pid in replicas:
        if pid in primaries:
            primaries[pid].append(rid)
    return {pid: rids for pid, rids in primaries.items() if rids}


class Node:
    """One redis-server of the cluster, in its own folder."""

    def __init__(self, name, folder):
        self.name = name
        self.folder = Path(folder)
        self.port = None
        self.proc = None

    @property
    def conf(self):
        return self.folder / "redis.conf"

    @property
    def log(self):
        return self.folder / "redis.log"

    @property
    def out(self):
        return self.folder / "redis.out"

    def endpoint(self):
        return "%s:%d" % (LOOPBACK, self.port)

    def failure_text(self):
        """The end of its log, and of its stdout when that has something."""
        text = "the end of its log (%s):\n%s" % (self.log, log_tail(self.log))
        if self.out.is_file() and self.out.stat().st_size:
            text += "\nits stdout and stderr (%s):\n%s" % (self.out, log_tail(self.out))
        return text


class RedisCluster:
    """N primaries with `replicas` replicas each (or, `standalone`, one node
    and no cluster), every node a redis-server on loopback under
    RUN_DIR/redis/. Not thread-safe: one launcher drives it."""

    def __init__(self, run_dir, primaries, maxmemory_mib=DEFAULT_MAXMEMORY_MIB,
                 node_timeout_ms=DEFAULT_NODE_TIMEOUT_MS, replicas=1, standalone=False):
        if standalone:
            primaries, replicas = 1, 0
        elif primaries < MIN_PRIMARIES:
            raise Failure("a Redis Cluster needs at least %d primaries (redis-cli --cluster "
                          "create refuses fewer), not %d" % (MIN_PRIMARIES, primaries))
        if replicas < 0:
            raise Failure("replicas per primary must not be negative, not %d" % replicas)
        self.run_dir = Path(run_dir)
        self.primaries = primaries
        self.replicas = replicas
        self.standalone = standalone
        self.maxmemory_mib = maxmemory_mib
        self.node_timeout_ms = node_timeout_ms
        self.folder = self.run_dir / FOLDER_NAME
        # The first N are created as primaries; redis-cli makes the rest
        # their replicas.
        self.nodes = [Node("redis-%d" % i, self.folder / ("redis-%d" % i))
                      for i in range(primaries * (1 + replicas))]
        self.password = None
        self.server, self.cli = None, None

    @property
    def procs(self):
        return [n.proc for n in self.nodes if n.proc is not None]

    def seeds(self):
        """The primaries' "host:port", as created."""
        return [n.endpoint() for n in self.nodes[:self.primaries]]

    def url(self):
        """The --kdn-redis URL, every primary a seed, with the password (for
        programs that are not kdn's workers)."""
        return url(self.password, self.seeds())

    def worker_url(self):
        """The workers' --kdn-redis URL: every primary a seed, no password
        (they read RUN_DIR/redis.password with --kdn-redis-password-file)."""
        return url(None, self.seeds())

    def start(self, timeout, on_start=lambda proc: None):
        """Starts every node, creates the cluster and waits until every node
        reports it whole (within `timeout` seconds). `on_start(proc)` is
        called with each node's Proc as it starts. On failure it stops what
        it started and raises Failure."""
        self.server, self.cli = require_redis()
        try:
            self._start(timeout, on_start)
        except BaseException:
            self.stop(quiet=True)
            raise
        return self

    def _start(self, timeout, on_start):
        deadline = time.monotonic() + timeout
        # A node of an earlier cluster would keep its nodes.conf and refuse
        # to join a new one.
        shutil.rmtree(self.folder, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.password = make_password(self.run_dir)
        for node in self.nodes:
            node.folder.mkdir(parents=True)
        ports = pick_ports(2 * len(self.nodes))
        for k, node in enumerate(self.nodes):
            self.start_node(node, ports[2 * k], ports[2 * k + 1], on_start)
        for node in self.nodes:
            for _ in range(PORT_TRIES):
                if not self.wait_serving(node, deadline):
                    break
                # Its port was taken between pick_ports and its start.
                port, cluster_port = pick_ports(2)
                self.start_node(node, port, cluster_port, on_start)
            else:
                raise Failure("%s (redis-server) found its port taken %d times; %s"
                              % (node.name, PORT_TRIES, node.failure_text()))
        if self.standalone:
            return
        rc, out = self.run_cli(["--cluster", "create"] + [n.endpoint() for n in self.nodes] +
                               ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                               max(1.0, deadline - time.monotonic()))
        if rc != 0:
            raise Failure("redis-cli --cluster create failed (exit code %d):\n%s\nthe first "
                          "node's log: %s" % (rc, log_lines(out), self.nodes[0].log))
        for node in self.nodes:
            self.wait_whole(node, deadline)

    def start_node(self, node, port, cluster_port, on_start):
        node.port = port
        try:
            node.log.unlink()  # a start that lost its port logged that
        except FileNotFoundError:
            pass
        write_private(node.conf, common_conf(self.password, self.maxmemory_mib,
                                             self.node_timeout_ms, not self.standalone) +
                      node_conf(LOOPBACK, port, None if self.standalone else cluster_port,
                                node.folder))
        with open(node.out, "wb") as out:
            popen = subprocess.Popen([self.server, str(node.conf)], stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        node.proc = Proc(node.name, "redis", [self.server, str(node.conf)], self.run_dir,
                         popen=popen, endpoint="redis://" + node.endpoint())
        node.proc.log, node.proc.out = str(node.log), str(node.out)
        on_start(node.proc)

    def node_cli(self, node, *args, timeout=10.0):
        return cli(self.cli, self.password, node.port, *args, timeout=timeout)

    def run_cli(self, args, timeout):
        """redis-cli ARGS (no host: --cluster names them)."""
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        try:
            r = subprocess.run([self.cli] + args, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, "did not finish within %.0f s" % timeout
        return r.returncode, r.stdout + r.stderr

    def wait_serving(self, node, deadline):
        """Until `node` answers PING. True when it exited because its port
        was taken (the caller starts it again on others)."""
        while True:
            if not node.proc.alive():
                if "Address already in use" in read_text(node.log) + read_text(node.out):
                    return True
                raise Failure("%s (redis-server on port %d) %s; %s"
                              % (node.name, node.port, node.proc.exit_text(),
                                 node.failure_text()))
            rc, out = self.node_cli(node, "ping", timeout=2.0)
            if rc == 0 and out.strip() == "PONG":
                return False
            if time.monotonic() > deadline:
                raise Failure("%s (redis-server on port %d) did not answer PING in time "
                              "(last: %s); %s" % (node.name, node.port, out.strip()[:200],
                                                  node.failure_text()))
            time.sleep(0.05)

    def wait_whole(self, node, deadline):
        """Until `node` reports the cluster ok, with every node known and
        every primary holding slots, and, a replica, its link to its primary
        up (synced: it has what the primary has)."""
        want = {"cluster_state": "ok", "cluster_known_nodes": str(len(self.nodes)),
                "cluster_size": str(self.primaries)}
        while True:
            if not node.proc.alive():
                raise Failure("%s (redis-server on port %d) %s; %s"
                              % (node.name, node.port, node.proc.exit_text(),
                                 node.failure_text()))
            rc, out = self.node_cli(node, "cluster", "info", timeout=2.0)
            fields = info_fields(out)
            pairs = 0
            if rc == 0 and all(fields.get(k) == v for k, v in want.items()):
                rc, out = self.node_cli(node, "cluster", "nodes", timeout=2.0)
                pairs = len(replica_pairs(out)) if rc == 0 else 0
                if pairs == (self.primaries if self.replicas else 0):
                    rc, out = self.node_cli(node, "info", "replication", timeout=2.0)
                    rep = info_fields(out) if rc == 0 else {}
                    if rep.get("role") == "master" or rep.get("master_link_status") == "up":
                        return
            if time.monotonic() > deadline:
                got = ", ".join("%s:%s" % (k, fields.get(k, "?")) for k in want)
                raise Failure("%s (port %d) did not report the cluster whole in time (%s, "
                              "%d primaries with a replica; want %s, %d); its log: %s"
                              % (node.name, node.port, got, pairs,
                                 ", ".join("%s:%s" % kv for kv in want.items()),
                                 self.primaries if self.replicas else 0, node.log))
            time.sleep(0.05)

    def stop(self, quiet=False):
        """Stops every node (SIGTERM, then SIGKILL after procs.STOP_WAIT_S)
        and removes the password and the nodes' redis.conf; the logs stay."""
        stop_all(self.procs, quiet=quiet)
        remove_secrets(self.run_dir)


def read_text(path):
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def log_lines(text, lines=20):
    text = text.strip().splitlines()
    return "\n".join("  | " + line for line in text[-lines:]) or "  (no output)"


def start_cluster(run_dir, primaries, maxmemory_mib=DEFAULT_MAXMEMORY_MIB,
                  node_timeout_ms=DEFAULT_NODE_TIMEOUT_MS, timeout=60.0,
                  on_start=lambda proc: None, replicas=1, standalone=False):
    """A started RedisCluster of `primaries` primaries and `replicas`
    replicas of each (`standalone`: one node, no cluster) under
    RUN_DIR/redis/, whole on every node; Failure (with what was started
    stopped) otherwise."""
    return RedisCluster(run_dir, primaries, maxmemory_mib, node_timeout_ms, replicas,
                        standalone).start(timeout, on_start)


def main(argv=None):
    """python3 -m kdn_launch.redis_cluster RUN_DIR [--primaries N] ...: starts
    a cluster (or one standalone node), prints its --kdn-redis URL on stdout,
    then one line per node, "host:port pid", primaries first, then serves
    until stdin closes or SIGTERM comes; then stops it. For programs that
    need Redis for a while: kdn-bench store --backends redis, and the tests
    (tests/kvbus/redis_cluster.h)."""
    import argparse
    import signal
    import sys
    p = argparse.ArgumentParser(prog="python3 -m kdn_launch.redis_cluster",
                                description=main.__doc__)
    p.add_argument("run_dir")
    p.add_argument("--primaries", type=int, default=MIN_PRIMARIES)
    p.add_argument("--replicas", type=int, default=1, help="replicas of each primary")
    p.add_argument("--standalone", action="store_true",
                   help="one node, no cluster (--primaries and --replicas ignored)")
    p.add_argument("--maxmemory-mib", type=int, default=DEFAULT_MAXMEMORY_MIB,
                   help="per node; 0: unbounded")
    p.add_argument("--node-timeout-ms", type=int, default=DEFAULT_NODE_TIMEOUT_MS)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the cluster to come up whole")
    a = p.parse_args(argv)
    try:
        cluster = start_cluster(a.run_dir, a.primaries, a.maxmemory_mib, a.node_timeout_ms,
                                a.timeout, replicas=a.replicas, standalone=a.standalone)
    except Failure as e:
        print("redis_cluster: %s" % e, file=sys.stderr)
        return 1
    def on_term(*_):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)
    try:
        print(cluster.url(), flush=True)
        try:
            for node in cluster.nodes:
                print("%s %d" % (node.endpoint(), node.proc.pid), flush=True)
        except BrokenPipeError:
            pass  # a reader that took the URL alone: the cluster serves on
        sys.stdin.read()
    finally:
        cluster.stop(quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
