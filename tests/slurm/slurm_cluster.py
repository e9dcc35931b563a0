"""A throwaway Slurm cluster on this host, from Debian's packages (munge,
slurmctld, slurmd): a generated munge key and slurm.conf, every daemon in the
foreground under one temporary folder, nothing written under /etc or /var.

Each emulated node is its own slurmd (`slurmd -N NAME`) with its own port and
its own loopback address (127.0.0.2, 127.0.0.3, ...), so that a job spanning
two nodes looks, to kdn, like a job spanning two hosts while all traffic stays
on loopback. Process tracking and task binding use the plugins that need no
cgroups (proctrack/linuxproc, task/none), so it runs as root in a container.

As a module: `Cluster(folder, nodes=2).start()`, then `cluster.env` for the
client commands (SLURM_CONF), `cluster.stop()`. As a script, for trying things
by hand:

    python3 tests/slurm/slurm_cluster.py /tmp/slurm 2   # start; Ctrl-C stops
"""

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
START_TIMEOUT_S = 60.0


class Unavailable(Exception):
    """The cluster cannot run here (missing package, daemon refuses to start)."""


def find(name):
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK) and os.path.isfile(path):
            return path
    return None


def free_port(addr="127.0.0.1"):
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def node_addr(i):
    """The loopback address of emulated node i (0-based): 127.0.0.2, .3, ..."""
    return "127.0.0.%d" % (i + 2)


class Cluster:
    def __init__(self, folder, nodes=1, cpus=2, gpus=0, partition="debug"):
        self.dir = Path(folder).resolve()
        self.nodes = ["kdn%d" % i for i in range(nodes)]
        self.cpus = cpus
        self.gpus = gpus
        self.partition = partition
        self.procs = {}
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ------------------------------------------------------------ config

    def write_config(self):
        d = self.dir
        for sub in ("munge", "ctld") + tuple("spool-" + n for n in self.nodes):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        if not key.exists():
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)
        host = socket.gethostname()
        ctld_port = free_port()
        lines = [
            "ClusterName=kdntest",
            "SlurmctldHost=%s(127.0.0.1)" % host,
            "SlurmctldPort=%d" % ctld_port,
            "SlurmUser=%s" % _user(),
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "AuthInfo=socket=%s" % (d / "munge" / "munge.socket"),
            "StateSaveLocation=%s" % (d / "ctld"),
            "SlurmdSpoolDir=%s" % (d / "spool-%n"),
            "SlurmctldPidFile=%s" % (d / "slurmctld.pid"),
            "SlurmdPidFile=%s" % (d / "slurmd-%n.pid"),
            "SlurmctldLogFile=%s" % (d / "slurmctld.log"),
            "SlurmdLogFile=%s" % (d / "slurmd-%n.log"),
            "PlugStackConfig=%s" % (d / "plugstack.conf"),
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
        ]
        gres = []
        if self.gpus:
            # Stand-in GPUs: character devices (the numbers of /dev/null) that
            # Slurm's gpu plugin hands out by index, setting CUDA_VISIBLE_DEVICES.
            lines.append("GresTypes=gpu")
            (d / "dev").mkdir(exist_ok=True)
            for n in self.nodes:
                for g in range(self.gpus):
                    dev = d / "dev" / ("%s-gpu%d" % (n, g))
                    if not dev.exists():
                        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                gres.append("NodeName=%s Name=gpu File=%s"
                            % (n, d / "dev" / ("%s-gpu[0-%d]" % (n, self.gpus - 1))))
        (d / "gres.conf").write_text("\n".join(gres) + "\n")
        for i, n in enumerate(self.nodes):
            lines.append("NodeName=%s NodeHostname=%s NodeAddr=%s Port=%d CPUs=%d%s State=UNKNOWN"
                         % (n, host, node_addr(i), free_port(), self.cpus,
                            " Gres=gpu:%d" % self.gpus if self.gpus else ""))
        lines.append("PartitionName=%s Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
                     % self.partition)
        self.conf.write_text("\n".join(lines) + "\n")
        (d / "plugstack.conf").write_text("")

    # ----------------------------------------------------------- daemons

    def _spawn(self, name, cmd):
        log = open(self.dir / (name + ".stderr"), "wb")
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _daemon_failed(self):
        for name, p in self.procs.items():
            if p.poll() is not None:
                text = ""
                for f in (self.dir / (name + ".stderr"),
                          self.dir / ("slurmd-%s.log" % name[len("slurmd-"):])
                          if name.startswith("slurmd-") else self.dir / (name + ".log")):
                    try:
                        text += f.read_text(errors="replace")[-1500:]
                    except OSError:
                        pass
                return "%s exited with code %s: %s" % (name, p.returncode, text.strip())
        return None

    def start(self):
        missing = [n for n in DAEMONS + CLIENTS if find(n) is None]
        if missing:
            raise Unavailable("not installed: %s (Debian: apt-get install munge slurmctld "
                              "slurmd slurm-client)" % ", ".join(missing))
        self.write_config()
        m = self.dir / "munge"
        self._spawn("munged", [find("munged"), "--foreground", "--force",
                               "--key-file", str(m / "munge.key"),
                               "--socket", str(m / "munge.socket"),
                               "--pid-file", str(m / "munged.pid"),
                               "--log-file", str(m / "munged.log"),
                               "--seed-file", str(m / "munged.seed")])
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", [find("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._run(["scontrol", "ping"]).stdout.find("UP") >= 0,
                   "slurmctld to answer scontrol ping")
        for n in self.nodes:
            self._spawn("slurmd-" + n, [find("slurmd"), "-D", "-f", str(self.conf), "-N", n])
        self._wait(self._nodes_idle, "every node to be idle in sinfo")
        return self

    def _run(self, cmd, timeout=15):
        try:
            return subprocess.run(cmd, env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(cmd, 124, e.stdout or "", e.stderr or "")

    def _nodes_idle(self):
        r = self._run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, what):
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            failed = self._daemon_failed()
            if failed:
                self.stop()
                raise Unavailable(failed)
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable("timed out after %.0f s waiting for %s" % (START_TIMEOUT_S, what))
            time.sleep(0.2)

    def stop(self):
        """Cancels every job, then stops the daemons (slurmd, slurmctld, munged)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--user", _user()])
        order = sorted(self.procs, key=lambda n: (not n.startswith("slurmd"), n == "munged"))
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs.clear()


def _user():
    import pwd
    return pwd.getpwuid(os.getuid()).pw_name


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    folder = Path(argv[1])
    nodes = int(argv[2]) if len(argv) > 2 else 1
    if folder.exists():
        shutil.rmtree(folder)
    c = Cluster(folder, nodes=nodes)
    try:
        c.start()
    except Unavailable as e:
        print("cannot start the cluster: %s" % e, file=sys.stderr)
        return 1
    print("export SLURM_CONF=%s" % c.conf, flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
