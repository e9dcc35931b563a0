"""kdn-launch's Redis Cluster (docs/launch.md and docs/slurm.md, "Redis
Cluster"): the flags that point the workers at one, and real clusters of
Debian's redis-server, started by the launcher's own code, on loopback:
- start_cluster (what `up --redis-cluster N` runs), called directly;
- the Slurm job script's cluster (`slurm submit --redis-cluster`), run
  under bash with stand-in Slurm commands on three "nodes" that are all
  127.0.0.1, where the stand-in srun runs the Redis steps for real.

The workers' --kdn-redis is checked only in their argv: these tests start
no kdn process.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

import pytest

from deploy_util import REPO, launch, pid_alive, wait_until
from test_launch_argv import FAKE_TOOLS, argvs_of_both, dry_run_argvs, flag, write_tools
from test_launch_argv import fake_slurm  # noqa: F401 (a fixture)

sys.path.insert(0, str(REPO / "launch"))
from kdn_launch import local, redis_cluster  # noqa: E402
from kdn_launch.plan import WorkerDevice  # noqa: E402
from kdn_launch.procs import Proc  # noqa: E402

HAVE_REDIS = all(shutil.which(t) for t in ("redis-server", "redis-cli"))
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server and redis-cli are not "
                                 "installed (Debian package redis-server)")
WORKERS = ("prefill-0", "decode-0")
READY_S = 30  # for a cluster of six nodes on loopback, which takes a few seconds


@pytest.fixture
def model_dir(tmp_path):
    """A model folder as the launcher checks it: config.json only."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def cli(port, *args, password=None):
    """redis-cli ARGS at 127.0.0.1:port; (returncode, output). With a
    password, from the environment, as the launcher passes it."""
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port)] + list(args),
                       capture_output=True, text=True, env=env, timeout=10)
    return r.returncode, r.stdout + r.stderr


def cluster_view(port, password):
    """(cluster info fields, {primary id: [replica ids]}, {id: port}) as the
    node at `port` sees them."""
    _, info = cli(port, "cluster", "info", password=password)
    _, nodes = cli(port, "cluster", "nodes", password=password)
    ports = {line.split()[0]: int(line.split()[1].split("@")[0].rsplit(":", 1)[1])
             for line in nodes.splitlines() if line.strip()}
    return redis_cluster.info_fields(info), redis_cluster.replica_pairs(nodes), ports


def wait_whole(ports, primaries, password):
    """Waits until every node reports the cluster ok, of `primaries` shards,
    each primary with one replica; returns the last node's pairs."""
    views = {}

    def whole():
        for port in ports:
            info, pairs, _ = views[port] = cluster_view(port, password)
            if not (info.get("cluster_state") == "ok" and
                    info.get("cluster_size") == str(primaries) and
                    len(pairs) == primaries and all(len(r) == 1 for r in pairs.values())):
                return False
        return True

    assert wait_until(whole, READY_S, step=0.1), views
    return views


def process_args(pids):
    """{pid: the args `ps` shows}."""
    r = subprocess.run(["ps", "-o", "pid=,args=", "-p", ",".join(map(str, pids))],
                       capture_output=True, text=True)
    return {int(line.split(None, 1)[0]): line.split(None, 1)[1]
            for line in r.stdout.splitlines() if line.strip()}


def redis_servers_under(folder):
    """Pids of the redis-server processes whose argv names a path under `folder`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                args = f.read().decode(errors="replace")
        except OSError:
            continue
        if "redis-server" in args and str(folder) in args and pid_alive(int(entry)):
            pids.append(int(entry))
    return pids


# ---------------------------------------------------------------- flags


def test_workers_take_an_existing_cluster_in_both_modes(tmp_path, model_dir):
    url = "redis://:s3cret@10.0.0.1:7000,10.0.0.2:7000"
    argvs = dry_run_argvs(tmp_path / "run", model_dir, ["--kdn-redis", url, "--store-codec",
                                                        "q4"])
    assert sorted(argvs) == ["decode-0", "prefill-0", "router"]
    for name in WORKERS:
        assert flag(argvs[name], "--kdn-redis") == url, argvs[name]
        assert flag(argvs[name], "--store-codec") == "q4", argvs[name]
        assert "--store" not in argvs[name], argvs[name]
    assert "--kdn-redis" not in argvs["router"]


def test_an_existing_cluster_reaches_the_workers_the_same_way_under_slurm(tmp_path, model_dir,
                                                                        fake_slurm):
    url = "redis://user:pw@10.0.0.1:7000"
    argvs = argvs_of_both(tmp_path, model_dir, ["--host", "127.0.0.1", "--port", 0,
                                                "--kdn-redis", url], fake_slurm)
    for name in WORKERS:
        assert flag(argvs[name], "--kdn-redis") == url and "--store" not in argvs[name]


def test_an_existing_clusters_password_reaches_the_workers_in_a_file(tmp_path, model_dir,
                                                                    fake_slurm):
    secret = tmp_path / "redis.password"
    secret.write_text("s3cret\n")
    url = "redis://10.0.0.1:7000,10.0.0.2:7000"
    # Relative on the command line, absolute to the workers (which may start
    # elsewhere); under Slurm the same.
    argvs = argvs_of_both(tmp_path, model_dir, ["--host", "127.0.0.1", "--port", 0,
                                                "--kdn-redis", url, "--kdn-redis-password-file",
                                                os.path.relpath(secret)], fake_slurm)
    for name in WORKERS:
        assert flag(argvs[name], "--kdn-redis") == url, argvs[name]
        assert flag(argvs[name], "--kdn-redis-password-file") == str(secret), argvs[name]
        assert not any("s3cret" in str(w) for w in argvs[name]), argvs[name]
    assert "--kdn-redis-password-file" not in argvs["router"]


@pytest.mark.parametrize("flags, message", [
    (["--kdn-redis-password-file", "/etc/hostname"], "goes with --kdn-redis"),
    (["--kdn-redis", "redis://:secret@h:1", "--kdn-redis-password-file", "/etc/hostname"],
     "has a password already"),
    (["--kdn-redis", "redis://h:1", "--kdn-redis-password-file", "/no/such/file"],
     "is not a file"),
    (["--kdn-redis", "redis://h:1", "--store"], "not allowed with argument"),
    (["--kdn-redis", "redis://h:1", "--redis-cluster", "3"], "not allowed with argument"),
    (["--store", "--redis-cluster", "3"], "not allowed with argument"),
    (["--redis-cluster", "2"], "a Redis Cluster needs at least 3 primaries"),
    (["--redis-cluster", "x"], "'x' is not an integer"),
    (["--kdn-redis", "http://h:1"], "does not begin with redis://"),
    (["--kdn-redis", "redis://:secret@h"], "'h' is not HOST:PORT"),
])
def test_contradicting_or_malformed_redis_flags_are_usage_errors(tmp_path, model_dir, flags,
                                                                 message):
    r = launch("up", "--dry-run", "--run-dir", tmp_path / "run", "--model", model_dir, *flags)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert "secret" not in r.stderr


def test_deployment_json_records_no_redis_password(tmp_path):
    cmd = ["kdn-prefill", "--kdn-redis", "redis://:s3cret@127.0.0.1:7000,127.0.0.1:7001",
           "--name", "prefill-0"]
    recorded = Proc("prefill-0", "prefill", cmd, tmp_path, pid=1,
                    device=WorkerDevice("cpu")).to_json()["cmd"]
    assert recorded == ["kdn-prefill", "--kdn-redis", "redis://:***@127.0.0.1:7000,127.0.0.1:7001",
                        "--name", "prefill-0"]
    # A password may hold / : @ (a random one often has /): all of it goes.
    for url, shown in [("redis://:a/b@c:d@h:1,g:2", "redis://:***@h:1,g:2"),
                       ("redis://bob:p:w/@h:1", "redis://bob:***@h:1"),
                       ("redis://bob@h:1", "redis://bob@h:1"),
                       ("redis://h:1", "redis://h:1")]:
        assert Proc("p", "prefill", ["kdn-prefill", "--kdn-redis", url], tmp_path, pid=1,
                    device=WorkerDevice("cpu")).to_json()["cmd"][2] == shown, url


def test_dry_run_shows_the_cluster_nodes_and_the_workers_url(tmp_path, model_dir):
    argvs = dry_run_argvs(tmp_path / "run", model_dir, ["--redis-cluster", 3])
    nodes = ["redis-%d" % i for i in range(6)]
    assert sorted(argvs) == sorted(nodes + ["decode-0", "prefill-0", "router"])
    for name in nodes:
        # Everything else, the password too, is in its redis.conf.
        assert argvs[name][1:] == [str(tmp_path / "run" / "redis" / name / "redis.conf")]
    for name in WORKERS:
        assert flag(argvs[name], "--kdn-redis") == \
            "redis://redis-0-ENDPOINT,redis-1-ENDPOINT,redis-2-ENDPOINT"
        assert flag(argvs[name], "--kdn-redis-password-file") == \
            str(tmp_path / "run" / "redis.password")
        assert "--store" not in argvs[name]


def test_slurm_refuses_a_cluster_on_fewer_than_three_nodes(tmp_path, model_dir, fake_slurm):
    env = dict(os.environ, PATH="%s:%s" % (fake_slurm, os.environ["PATH"]))
    r = launch("slurm", "submit", "--run-dir", tmp_path / "run", "--model", model_dir,
               "--nodes", 2, "--prefill", 2, "--decode", 1, "--redis-cluster", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--redis-cluster puts one primary on each node and needs at least 3" in r.stderr
    assert not (tmp_path / "run" / "kdn.sbatch").exists()


def test_slurm_job_script_places_each_replica_on_the_next_node(tmp_path, model_dir, fake_slurm):
    env = dict(os.environ, PATH="%s:%s" % (fake_slurm, os.environ["PATH"]))
    run = tmp_path / "run"
    r = launch("slurm", "submit", "--run-dir", run, "--model", model_dir, "--nodes", 3,
               "--prefill", 2, "--decode", 1, "--redis-cluster", "--redis-maxmemory-mib", 64,
               env=env)
    assert r.returncode == 0, r.stderr
    script = (run / "kdn.sbatch").read_text()
    for i, node in ((0, 1), (1, 2), (2, 0)):
        assert "start redis-p%d %d -1 bash -c 'redis_main \"$@\"' redis_main \"${addrs[%d]}\"" \
            % (i, i, i) in script
        assert "start redis-r%d %d -1 bash -c 'redis_main \"$@\"' redis_main \"${addrs[%d]}\"" \
            % (i, node, node) in script
    assert "KDN_REDIS=$(redis_cluster 3) || abort" in script
    assert script.count('--kdn-redis "$KDN_REDIS"') == 3
    password = (run / "redis.password").read_text().strip()
    assert password not in script
    common = run / "redis" / "common.conf"
    for path in (run / "redis.password", common):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert "requirepass %s\n" % password in common.read_text()
    assert "maxmemory 64mb\n" in common.read_text()
    roles = json.loads((run / "slurm.json").read_text())["roles"]
    assert {(x["name"], x["node"]) for x in roles if x["role"] == "redis"} == \
        {("redis-p0", 0), ("redis-p1", 1), ("redis-p2", 2),
         ("redis-r0", 1), ("redis-r1", 2), ("redis-r2", 0)}


# ------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not HAVE_REDIS:
        pytest.skip("redis-server and redis-cli are not installed (Debian package "
                    "redis-server)")
    c = redis_cluster.start_cluster(tmp_path_factory.mktemp("redis-run"), 3, timeout=READY_S)
    try:
        yield c
    finally:
        c.stop(quiet=True)


def test_cluster_has_three_shards_each_with_a_replica(cluster):
    ports = [n.port for n in cluster.nodes]
    views = wait_whole(ports, 3, cluster.password)
    info, pairs, by_id = views[ports[0]]
    assert info["cluster_state"] == "ok" and info["cluster_size"] == "3", info
    # The primaries are the URL's seeds.
    assert sorted(by_id[p] for p in pairs) == sorted(n.port for n in cluster.nodes[:3])
    assert cluster.url() == "redis://:%s@%s" % (
        cluster.password, ",".join("127.0.0.1:%d" % n.port for n in cluster.nodes[:3]))
    for node in cluster.nodes:
        assert (node.folder / "nodes.conf").is_file() and node.log.is_file(), node.folder


def test_the_password_is_a_private_file_and_required(cluster):
    path = redis_cluster.password_path(cluster.run_dir)
    assert path.read_text().strip() == cluster.password
    assert len(cluster.password) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for node in cluster.nodes:
        assert stat.S_IMODE(node.conf.stat().st_mode) == 0o600, node.conf
        rc, out = cli(node.port, "set", "k", "v")
        assert "NOAUTH" in out, out
        rc, out = cli(node.port, "ping", password=cluster.password)
        assert (rc, out.strip()) == (0, "PONG")


def test_no_process_listing_shows_the_password(cluster):
    pids = [p.pid for p in cluster.procs]
    args = process_args(pids)
    assert sorted(args) == sorted(pids), args
    for pid, line in args.items():
        assert cluster.password not in line, line
        assert line.startswith(shutil.which("redis-server") + " "), line


@needs_redis
def test_a_node_that_cannot_start_fails_with_its_log_and_stops_the_rest(tmp_path, monkeypatch):
    conf = redis_cluster.common_conf
    monkeypatch.setattr(redis_cluster, "common_conf",
                        lambda *args: conf(*args) + "no-such-setting yes\n")
    run = tmp_path / "run"
    procs = []
    with pytest.raises(redis_cluster.Failure) as e:
        redis_cluster.start_cluster(run, 3, timeout=READY_S, on_start=procs.append)
    text = str(e.value)
    assert re.match(r"redis-0 \(redis-server on port \d+\) exited with code 1; the end of "
                    r"its log \(%s\)" % re.escape(str(run / "redis" / "redis-0" / "redis.log")),
                    text), text
    assert "no-such-setting" in text, text
    assert len(procs) == 6 and not any(p.alive() for p in procs)
    assert redis_servers_under(run) == []
    assert not redis_cluster.password_path(run).exists()


def test_down_stops_the_redis_servers_it_recorded(tmp_path):
    if not HAVE_REDIS:
        pytest.skip("redis-server and redis-cli are not installed (Debian package "
                    "redis-server)")
    run = tmp_path / "run"
    procs = []
    try:
        c = redis_cluster.start_cluster(run, 3, node_timeout_ms=2000, timeout=READY_S,
                                        on_start=procs.append)
        # What `up --redis-cluster 3 --detach` records of them.
        local.write_deployment(run, {"url": None, "processes": [p.to_json() for p in procs],
                                     "started": int(time.time()), "launcher_pid": None})
        assert len(redis_servers_under(run)) == 6
        r = launch("down", "--run-dir", run, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert redis_servers_under(run) == []
        assert not redis_cluster.password_path(run).exists()
        assert all(not n.conf.exists() for n in c.nodes)
        assert all(n.log.is_file() for n in c.nodes)  # the logs stay
    finally:
        for p in procs:
            p.signal(9)


# ------------------------------------------- the Slurm job script's cluster

# Stand-ins for a job on three nodes, node0 to node2, all at 127.0.0.1: srun
# runs a Redis step for real (in the background, as srun would on its node)
# and gives the others a made-up endpoint; squeue lists the steps from their
# pid files, so that the script's stop reaches them with scancel --signal.
REDIS_JOB_TOOLS = dict(FAKE_TOOLS, **{
    "scontrol": r'''case "$1 $2" in
  "show hostnames") echo node0; echo node1; echo node2 ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3" ;;
  *) echo "Invalid job id specified" >&2; exit 1 ;;
esac
''',
    "srun": r'''out= err= name= node=
while [ $# -gt 0 ]; do
  case "$1" in
    --output=*) out=${1#--output=} ;;
    --error=*) err=${1#--error=} ;;
    --job-name=*) name=${1#--job-name=} ;;
    --nodelist=*) node=${1#--nodelist=} ;;
    bash) break ;;
  esac
  shift
done
case "$name" in
  redis-*) export SLURMD_NODENAME=$node; exec "$@" > "$out" 2> "$err" ;;
esac
shift 6
printf '%s\0' "$@" > "$KDN_FAKE_SRUN_DIR/$name"
if [ "$name" = router ]; then echo "http://router-ENDPOINT" > "$out"; else echo "tcp://$name-ENDPOINT" > "$out"; fi
''',
    "squeue": r'''for f in "$KDN_FAKE_PIDS"/*; do
  [ -f "$f" ] && echo "$(basename "$f") $(cut -d' ' -f2 "$f")"
done
exit 0
''',
    "scancel": r'''case "$1" in --signal=*) kill -"${1#--signal=}" "$2" ;; esac
exit 0
''',
})


@pytest.fixture
def redis_job_slurm(tmp_path):
    return write_tools(tmp_path / "redis-job-slurm", REDIS_JOB_TOOLS)


class RedisJob:
    """The job script of `slurm submit --nodes 3 --redis-cluster`, running
    under bash with the stand-ins of REDIS_JOB_TOOLS; its output in job.out."""

    NAMES = ["redis-p%d" % i for i in range(3)] + ["redis-r%d" % i for i in range(3)]

    def __init__(self, tmp_path, model, tools, break_conf=False):
        env = dict(os.environ, PATH="%s:%s" % (tools, os.environ["PATH"]))
        self.run = tmp_path / "run"
        r = launch("slurm", "submit", "--run-dir", self.run, "--model", model, "--nodes", 3,
                   "--prefill", 2, "--decode", 1, "--redis-cluster",
                   "--redis-node-timeout-ms", 2000, "--ready-timeout", READY_S, env=env)
        assert r.returncode == 0, r.stderr
        if break_conf:
            with open(self.run / "redis" / "common.conf", "a") as f:
                f.write("no-such-setting yes\n")
        self.steps = tmp_path / "steps"
        self.steps.mkdir()
        env.update(KDN_FAKE_SRUN_DIR=str(self.steps), KDN_FAKE_PIDS=str(self.run / "pids"),
                   SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[0-2]")
        self.out = open(tmp_path / "job.out", "w+")
        self.job = subprocess.Popen(["bash", str(self.run / "kdn.sbatch")], stdout=self.out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self):
        self.out.seek(0)
        return self.out.read()

    def close(self):
        if self.job.poll() is None:
            os.killpg(self.job.pid, 9)
        for pid in redis_servers_under(self.run):
            os.kill(pid, 9)
        self.out.close()


@needs_redis
def test_slurm_job_script_builds_the_cluster_and_stops_it(tmp_path, model_dir,
                                                          redis_job_slurm):
    job = RedisJob(tmp_path, model_dir, redis_job_slurm)
    run, names = job.run, RedisJob.NAMES
    try:
        assert wait_until(lambda: "kdn: serving on" in job.text() or job.job.poll() is not None,
                          READY_S + 10, step=0.1), job.text()
        assert "kdn: serving on http://router-ENDPOINT" in job.text(), job.text()
        password = (run / "redis.password").read_text().strip()
        ports = {n: int((run / "logs" / (n + ".out")).read_text().split("\n")[0].rsplit(":", 1)[1])
                 for n in names}
        views = wait_whole(ports.values(), 3, password)
        _, pairs, by_id = views[ports["redis-p0"]]
        # Each replica follows the primary of the node before its own.
        assert {by_id[p]: [by_id[r] for r in rs] for p, rs in pairs.items()} == \
            {ports["redis-p%d" % i]: [ports["redis-r%d" % i]] for i in range(3)}
        seeds = ",".join("127.0.0.1:%d" % ports["redis-p%d" % i] for i in range(3))
        for w in ("prefill-0", "prefill-1", "decode-0"):
            words = (job.steps / w).read_bytes().split(b"\0")[:-1]
            assert flag([x.decode() for x in words], "--kdn-redis") == "redis://" + seeds
            assert flag([x.decode() for x in words], "--kdn-redis-password-file") == \
                str(run / "redis.password")
        pids = {n: int((run / "pids" / n).read_text().split()[1]) for n in names}
        assert all(pid_alive(p) for p in pids.values())
        for pid, line in process_args(pids.values()).items():
            assert password not in line, line
        for n in names:
            conf = run / "redis" / n / "redis.conf"
            assert stat.S_IMODE(conf.stat().st_mode) == 0o600, conf
        job.job.terminate()  # what `kdn-launch slurm down` sends the script
        job.job.wait(timeout=60)
        assert "kdn: stopping (signal)" in job.text(), job.text()
        assert [n for n, p in pids.items() if pid_alive(p)] == []
    finally:
        job.close()


@needs_redis
def test_slurm_job_script_stops_when_a_redis_node_cannot_start(tmp_path, model_dir,
                                                               redis_job_slurm):
    job = RedisJob(tmp_path, model_dir, redis_job_slurm, break_conf=True)
    try:
        job.job.wait(timeout=READY_S + 10)
        assert job.job.returncode == 1, job.text()
        assert re.search(r"kdn: redis-[pr]\d ended before it answered PING; the end of its "
                         r"logs \(\S+/redis/redis-[pr]\d/redis.log", job.text()), job.text()
        assert "no-such-setting" in job.text(), job.text()  # redis-server's own words
        assert "kdn: the deployment did not start" in job.text()
        assert redis_servers_under(job.run) == []
        assert not (job.steps / "prefill-0").exists()  # no worker started
    finally:
        job.close()
