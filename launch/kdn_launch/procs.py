"""The processes of a local deployment: whether one still runs, the order in
which they stop, and the signals that interrupt the launcher."""

import os
import signal
import subprocess
import time
from pathlib import Path

from .argv import redacted
from .plan import WorkerDevice
from .util import Interrupted, info

STOP_WAIT_S = 10.0
# Stop order: the router first (no new requests), then the workers, then the
# store or the Redis Cluster they write to.
STOP_GROUPS = [("router",), ("prefill", "decode"), ("store", "redis")]


def pid_alive(pid, argv0=None):
    """True while `pid` runs (not a zombie) and, if /proc tells, still runs
    `argv0` (so that a reused pid is not taken for ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        if stat[stat.rindex(")") + 2:].startswith(("Z", "X")):
            return False
        if argv0 is not None:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                parts = [a.decode(errors="replace") for a in f.read().split(b"\0")[:3]]
            # argv[0], or argv[1] of a script's interpreter.
            if parts and parts[0] and argv0 not in parts and \
                    os.path.basename(parts[0]) != os.path.basename(argv0):
                return False
    except (OSError, ValueError):
        pass
    return True



class Proc:
    """One started process: a Popen when this launcher started it, else a pid."""

    def __init__(self, name, role, cmd, run_dir, popen=None, pid=None, endpoint=None,
                 device=None):
        self.name = name
        self.role = role
        self.cmd = cmd
        self.device = device  # a WorkerDevice for a worker, None for the others
        self.out = str(Path(run_dir) / "logs" / (name + ".out"))
        self.log = str(Path(run_dir) / "logs" / (name + ".log"))
        self.popen = popen
        self.pid = popen.pid if popen is not None else pid
        self.endpoint = endpoint
        self.reported_dead = False

    def alive(self):
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid, self.cmd[0] if self.cmd else None)

    def exit_text(self):
        if self.popen is None or self.popen.returncode is None:
            return "exited"
        rc = self.popen.returncode
        if rc < 0:
            try:
                return "was killed by %s" % signal.Signals(-rc).name
            except ValueError:
                return "was killed by signal %d" % -rc
        return "exited with code %d" % rc

    def signal(self, sig):
        if not self.alive():
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def to_json(self):
        # A --kdn-redis URL's password stays out of deployment.json; liveness
        # reads only argv[0].
        d = {"name": self.name, "role": self.role, "pid": self.pid,
             "endpoint": self.endpoint, "log": self.log, "out": self.out,
             "cmd": redacted(self.cmd)}
        if self.device is not None:
            d["device"] = self.device.name
            d["gpu_mem_fraction"] = self.device.fraction
        return d

    @staticmethod
    def from_json(d, run_dir):
        device = None
        if d.get("device"):
            device = WorkerDevice(d["device"], d.get("gpu_mem_fraction"))
        elif d["role"] in ("prefill", "decode"):
            device = WorkerDevice("cpu")  # written by a launcher older than --device
        p = Proc(d["name"], d["role"], d.get("cmd") or [], run_dir, pid=d["pid"],
                 endpoint=d.get("endpoint"), device=device)
        p.log = d.get("log", p.log)
        p.out = d.get("out", p.out)
        return p




def stop_all(procs, quiet=False):
    """SIGTERM each group in STOP_GROUPS order, wait up to STOP_WAIT_S for it,
    SIGKILL what is left. Returns the names that needed SIGKILL."""
    killed = []
    for roles in STOP_GROUPS:
        group = [p for p in procs if p.role in roles and p.alive()]
        if not group:
            continue
        if not quiet:
            info("stopping " + ", ".join("%s (pid %d)" % (p.name, p.pid) for p in group))
        for p in group:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and any(p.alive() for p in group):
            time.sleep(0.05)
        for p in group:
            if p.alive():
                info("%s (pid %d) did not stop in %.0f s: SIGKILL" % (p.name, p.pid, STOP_WAIT_S))
                p.signal(signal.SIGKILL)
                killed.append(p.name)
        for p in group:
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
    return killed


class SignalGuard:
    """Turns SIGINT/SIGTERM/SIGHUP into Interrupted while armed; ignores them
    (with a note) while disarmed, so a second Ctrl-C does not cut a shutdown."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.armed = True
        for s in self.SIGNALS:
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        if self.armed:
            self.armed = False
            raise Interrupted()
        info("shutting down, please wait")

