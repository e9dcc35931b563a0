"""kdn-launch --device, --gpus and --gpu-mem-fraction (docs/launch.md, "GPUs"),
without a GPU: the refusals, the assignment that --dry-run prints, and whole
`up` / `status` / `down` runs against stand-in workers (small Python scripts
that record their argv, print an endpoint and wait, or fail as a cuda worker
short of memory does), so no real worker is started on a GPU.
"""

import json
import os
import shlex
import sys

import pytest

from deploy_util import launch, pid_alive, wait_until

FAKE_WORKER = """\
#!{python}
import json, os, sys, time
name = sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else "store"
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, name + ".pid"), "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(here, name + ".argv"), "w") as f:
    json.dump(sys.argv, f)
if os.environ.get("FAKE_FAIL") == name:
    sys.stderr.write("loading the model\\n%s: --device cuda:0 --gpu-mem-fraction 0.45 leaves "
                     "no room for the KV pool\\n" % name)
    sys.exit(3)
print("tcp://127.0.0.1:9", flush=True)
time.sleep(600)
"""

# Writes the key files as kdn-keygen FILE --router FILE2 does: new, mode 0600.
FAKE_KEYGEN = """\
#!{python}
import os, sys
for path in (sys.argv[1], sys.argv[3]):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"stand-in key\\n")
    os.close(fd)
"""

FAKE_ROUTER = """\
#!{python}
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"status": "ok"}}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print("http://127.0.0.1:%d" % s.server_port, flush=True)
s.serve_forever()
"""


@pytest.fixture
def fake(tmp_path):
    """A bin dir of stand-in kdn-prefill, kdn-decode, kdn-store and kdn-router,
    a model folder with only config.json, and a run dir."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("kdn-prefill", FAKE_WORKER), ("kdn-decode", FAKE_WORKER),
                       ("kdn-store", FAKE_WORKER), ("kdn-router", FAKE_ROUTER),
                       ("kdn-keygen", FAKE_KEYGEN)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable))
        path.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    class Fake:
        pass
    f = Fake()
    f.bin_dir, f.model, f.run_dir = bin_dir, model, tmp_path / "run"
    f.args = ["--bin-dir", bin_dir, "--model", model, "--run-dir", f.run_dir, "--port", 0]
    f.argv = lambda name: json.loads((bin_dir / (name + ".argv")).read_text())
    f.pid = lambda name: int((bin_dir / (name + ".pid")).read_text())
    f.started = lambda: sorted(p.name for p in bin_dir.glob("*.argv"))
    return f


@pytest.fixture
def model_dir(tmp_path):
    """A model folder as --dry-run needs it: config.json only."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def plan(*args):
    """{name: argv} of `kdn-launch up --dry-run ARGS`."""
    r = launch("up", "--dry-run", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    out = {}
    for line in r.stdout.splitlines():
        name, _, cmd = line.partition(": ")
        out[name] = shlex.split(cmd)
    return out


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("args, code, message", [
    (["--gpus", "0"], 1, "--gpus needs --device cuda"),
    (["--gpu-mem-fraction", "0.5"], 1, "--gpu-mem-fraction needs --device cuda"),
    (["--device", "cuda", "--gpus", "0,1,0"], 2, "'0,1,0' lists GPU 0 twice"),
    (["--device", "cuda", "--gpus", "0,,1"], 2, "not a comma-separated list of GPU ids"),
    (["--device", "cuda", "--gpus", "cuda:0"], 2, "not a comma-separated list of GPU ids"),
    (["--device", "cuda", "--gpus", "-1"], 2, "not a comma-separated list of GPU ids"),
    (["--device", "cuda", "--gpus", ""], 2, "not a comma-separated list of GPU ids"),
    (["--device", "cuda", "--gpu-mem-fraction", "0"], 2, "must be more than 0 and at most 1"),
    (["--device", "cuda", "--gpu-mem-fraction", "1.01"], 2, "must be more than 0 and at most 1"),
    (["--device", "cuda", "--gpu-mem-fraction", "nan"], 2, "must be more than 0 and at most 1"),
    (["--device", "gpu"], 2, "invalid choice: 'gpu'"),
    (["--device", "cuda", "--gpus", "0,1,2"], 1,
     "--gpus lists 3 GPUs for 2 workers (1 prefill + 1 decode): GPU 2 would sit idle"),
    # Two workers on GPU 0 at 0.6 each: 1.2 of its memory.
    (["--device", "cuda", "--gpu-mem-fraction", "0.6"], 1,
     "the 2 workers on GPU 0 (prefill-0, decode-0) would take 1.2 of its memory"),
    # prefill-0, prefill-2 and decode-1 on GPU 0: 3 x 0.4.
    (["--device", "cuda", "--gpus", "0,1", "--prefill", "3", "--decode", "2",
      "--gpu-mem-fraction", "0.4"], 1,
     "the 3 workers on GPU 0 (prefill-0, prefill-2, decode-1) would take 1.2 of its memory, "
     "more than all of it; give at most 0.3333, or list more --gpus"),
])
@pytest.mark.parametrize("command", ["up", "demo"])
def test_refuses_gpu_flags_that_cannot_run_before_starting_anything(fake, command, args, code,
                                                                    message):
    r = launch(command, *fake.args, *args, timeout=60)
    assert r.returncode == code, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert lines[0].startswith("kdn-launch"), r.stderr
    assert fake.started() == [], "started %s" % fake.started()
    assert not fake.run_dir.exists()


def test_dry_run_deals_workers_over_the_gpus_prefill_first(model_dir):
    p = plan("--model", model_dir, "--device", "cuda", "--gpus", "0,1", "--prefill", 2,
             "--decode", 2)
    assert list(p) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "router"]
    devices = {name: (flag(argv, "--device"), flag(argv, "--gpu-mem-fraction"))
               for name, argv in p.items()}
    # Two workers per GPU: 0.9 / 2 each.
    assert devices == {"prefill-0": ("cuda:0", "0.45"), "prefill-1": ("cuda:1", "0.45"),
                       "decode-0": ("cuda:0", "0.45"), "decode-1": ("cuda:1", "0.45"),
                       "router": (None, None)}
    assert flag(p["router"], "--prefill") == "prefill-0-ENDPOINT,prefill-1-ENDPOINT"
    assert flag(p["router"], "--decode") == "decode-0-ENDPOINT,decode-1-ENDPOINT"


def test_dry_run_default_fractions_split_each_gpu_by_its_workers(model_dir):
    p = plan("--model", model_dir, "--device", "cuda", "--gpus", "1,0", "--prefill", 3,
             "--decode", 2)
    devices = {name: (flag(argv, "--device"), flag(argv, "--gpu-mem-fraction"))
               for name, argv in p.items() if name != "router"}
    # GPU 1 holds prefill-0, prefill-2 and decode-1 (0.9 / 3); GPU 0 the other two.
    assert devices == {"prefill-0": ("cuda:1", "0.3"), "prefill-1": ("cuda:0", "0.45"),
                       "prefill-2": ("cuda:1", "0.3"), "decode-0": ("cuda:0", "0.45"),
                       "decode-1": ("cuda:1", "0.3")}
    # 7 on one GPU: 0.9 / 7 rounded down to 4 decimals.
    p = plan("--model", model_dir, "--device", "cuda", "--prefill", 4, "--decode", 3)
    assert {flag(argv, "--device") for n, argv in p.items() if n != "router"} == {"cuda:0"}
    assert {flag(argv, "--gpu-mem-fraction") for n, argv in p.items() if n != "router"} == \
        {"0.1285"}


def test_dry_run_passes_a_given_fraction_to_every_worker(model_dir):
    p = plan("--model", model_dir, "--device", "cuda", "--gpus", "0,1", "--prefill", 2,
             "--decode", 2, "--gpu-mem-fraction", "0.5")
    assert [flag(argv, "--gpu-mem-fraction") for argv in p.values()] == ["0.5"] * 4 + [None]
    # One worker per GPU may take all of it.
    p = plan("--model", model_dir, "--device", "cuda", "--gpus", "0,1", "--gpu-mem-fraction", "1")
    assert [(flag(argv, "--device"), flag(argv, "--gpu-mem-fraction")) for argv in p.values()] \
        == [("cuda:0", "1.0"), ("cuda:1", "1.0"), (None, None)]


def test_dry_run_on_the_cpu_passes_the_flags_of_before(model_dir):
    """--device cpu (the default) passes no --device, so older workers run."""
    model = model_dir
    for extra in ([], ["--device", "cpu"]):
        p = plan("--model", model, "--bin-dir", "/b", "--store", "--run-dir", "/r", *extra)
        curve = ["--curve-keys", "/r/curve.key"]
        common = ["--model", str(model), "--listen", "tcp://127.0.0.1:0", "--host-mib", "2048",
                  "--chunk-tokens", "256", "--threads", "0", "--weights-dtype", "native",
                  "--kv-transport", "auto", *curve, "--store", "store-ENDPOINT", "--store-codec",
                  "raw"]
        assert p == {
            "store": ["/b/kdn-store", "--listen", "tcp://127.0.0.1:0", "--host-mib", "4096",
                      *curve],
            "prefill-0": ["/b/kdn-prefill"] + common + ["--name", "prefill-0"],
            "decode-0": ["/b/kdn-decode"] + common + ["--kvbus-listen", "tcp://127.0.0.1:0",
                                                      "--name", "decode-0"],
            "router": ["/b/kdn-router", "--model", str(model), "--prefill", "prefill-0-ENDPOINT",
                       "--decode", "decode-0-ENDPOINT", "--host", "127.0.0.1", "--port", "8000",
                       "--recompute-ratio", "0.15", "--curve-keys", "/r/router.key"],
        }, p
    # --no-curve: plaintext, no key.
    p = plan("--model", model, "--bin-dir", "/b", "--run-dir", "/r", "--no-curve")
    assert all("--curve-keys" not in argv for argv in p.values()), p
    # The router's own flags, given: passed on.
    p = plan("--model", model, "--bin-dir", "/b", "--run-dir", "/r", "--no-curve",
             "--max-queued", "5", "--max-connections", "9", "--no-resume")
    router = p["router"]
    assert flag(router, "--max-queued") == "5" and flag(router, "--max-connections") == "9"
    assert "--no-resume" in router, router


def test_up_status_down_with_stand_in_cuda_workers(fake):
    r = launch("up", "--detach", *fake.args, "--device", "cuda", "--gpus", "0,1",
               "--prefill", 2, "--decode", 2, "--store", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prefill-0 on cuda:0 (0.45 of its memory)" in r.stderr, r.stderr
    info = json.loads((fake.run_dir / "deployment.json").read_text())
    try:
        for name, gpu in (("prefill-0", 0), ("prefill-1", 1), ("decode-0", 0), ("decode-1", 1)):
            argv = fake.argv(name)
            assert argv[-4:] == ["--device", "cuda:%d" % gpu, "--gpu-mem-fraction", "0.45"], argv
            p = next(p for p in info["processes"] if p["name"] == name)
            assert (p["device"], p["gpu_mem_fraction"]) == ("cuda:%d" % gpu, 0.45), p
        assert "--device" not in fake.argv("store")
        # New deployment keys, private to this user: the members' for the
        # workers and the store, the router's for the router.
        key, router_key = (fake.run_dir.resolve() / n for n in ("curve.key", "router.key"))
        assert key.stat().st_mode & 0o777 == 0o600
        assert router_key.stat().st_mode & 0o777 == 0o600
        for name in ("store", "prefill-0", "prefill-1", "decode-0", "decode-1"):
            assert flag(fake.argv(name), "--curve-keys") == str(key), fake.argv(name)
        router = next(p for p in info["processes"] if p["name"] == "router")
        assert flag(router["cmd"], "--curve-keys") == str(router_key), router["cmd"]
        assert all("device" not in p for p in info["processes"]
                   if p["role"] in ("router", "store"))
        st = launch("status", "--run-dir", fake.run_dir)
        assert st.returncode == 0, st.stdout + st.stderr
        header, *rows = st.stdout.splitlines()
        assert header.split()[:7] == ["NAME", "ROLE", "PID", "STATE", "DEVICE", "GPU-MEM",
                                      "ENDPOINT"]
        shown = {row.split()[0]: row.split()[4:6] for row in rows[:6]}
        assert shown == {"store": ["-", "-"], "prefill-0": ["cuda:0", "0.45"],
                         "prefill-1": ["cuda:1", "0.45"], "decode-0": ["cuda:0", "0.45"],
                         "decode-1": ["cuda:1", "0.45"], "router": ["-", "-"]}, st.stdout
    finally:
        down = launch("down", "--run-dir", fake.run_dir, timeout=60)
    assert down.returncode == 0, down.stdout + down.stderr
    pids = [p["pid"] for p in info["processes"]]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5)
    assert not (fake.run_dir / "curve.key").exists()
    assert not (fake.run_dir / "router.key").exists()


def test_a_worker_that_fails_at_start_is_reported_with_its_log(fake):
    """A cuda worker short of memory exits before it prints its endpoint: `up`
    fails at once with the end of its stderr and stops the others."""
    env = dict(os.environ, FAKE_FAIL="decode-0")
    r = launch("up", "--detach", *fake.args, "--device", "cuda", "--prefill", 2,
               "--ready-timeout", 120, timeout=60, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "kdn-launch: error: decode-0 exited with code 3 before serving" in r.stderr, r.stderr
    assert ("| decode-0: --device cuda:0 --gpu-mem-fraction 0.45 leaves no room for the KV pool"
            in r.stderr), r.stderr
    assert "decode-0.log" in r.stderr
    assert fake.argv("decode-0")[-4:] == ["--device", "cuda:0", "--gpu-mem-fraction", "0.3"]
    assert not (fake.run_dir / "deployment.json").exists()
    # The prefill workers, started before it, were stopped.
    pids = [fake.pid("prefill-0"), fake.pid("prefill-1")]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5)
    st = launch("status", "--run-dir", fake.run_dir)
    assert st.returncode == 1 and "nothing is running" in st.stdout, st.stdout


def test_status_shows_cpu_workers(deployment):
    r = launch("status", "--run-dir", deployment.run_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in deployment.info["processes"]:
        assert "--device" not in p["cmd"], p["cmd"]
        row = next(l for l in r.stdout.splitlines() if l.split()[:1] == [p["name"]])
        assert row.split()[4] == ("-" if p["role"] == "router" else "cpu"), row


@pytest.fixture
def fake_slurm(tmp_path):
    """An environment whose PATH starts with stand-in Slurm clients: sbatch
    prints job id 4242, the others answer nothing."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", "echo 4242"), ("squeue", "true"), ("scontrol", "true"),
                       ("scancel", "true")):
        (bin_dir / name).write_text("#!/bin/sh\n%s\n" % text)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ.get("PATH", "")))


@pytest.mark.parametrize("args, worker_flags", [
    ([], ""),
    (["--device", "cpu", "--gpus-per-worker", 1], ""),
    (["--device", "cuda", "--gpus-per-worker", 1], " --device cuda:0 --gpu-mem-fraction 0.9"),
    (["--device", "cuda", "--gpus-per-worker", 2, "--gpu-mem-fraction", "0.75"],
     " --device cuda:0 --gpu-mem-fraction 0.75"),
])
def test_slurm_submit_gives_each_worker_its_device(fake, fake_slurm, args, worker_flags):
    r = launch("slurm", "submit", "--bin-dir", fake.bin_dir, "--model", fake.model,
               "--run-dir", fake.run_dir, *args, env=fake_slurm, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "4242", r.stdout + r.stderr
    script = (fake.run_dir / "kdn.sbatch").read_text()
    key = fake.run_dir.resolve() / "curve.key"
    for name in ("prefill-0", "decode-0"):
        worker = next(line for line in script.splitlines() if line.startswith("start " + name))
        assert worker.endswith("--name %s%s" % (name, worker_flags)), worker
        assert ("--model %s --listen \"$(listen 0)\" --host-mib 2048 --chunk-tokens 256 "
                "--threads 0 --weights-dtype native --kv-transport auto --curve-keys %s"
                % (fake.model.resolve(), key)) \
            in worker, worker
    # The job's keys, private to this user; the router's for the router.
    assert key.stat().st_mode & 0o777 == 0o600
    router = next(line for line in script.splitlines() if line.startswith("start router"))
    assert "--curve-keys %s" % key.with_name("router.key") in router, router


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "--device cuda needs --gpus-per-worker"),
    (["--gpu-mem-fraction", "0.5", "--gpus-per-worker", 1],
     "--gpu-mem-fraction needs --device cuda"),
])
def test_slurm_submit_refuses_gpu_flags_that_cannot_run(fake, fake_slurm, args, message):
    r = launch("slurm", "submit", "--bin-dir", fake.bin_dir, "--model", fake.model,
               "--run-dir", fake.run_dir, *args, env=fake_slurm, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdn-launch: error: ") and \
        message in lines[0], r.stderr
    assert not fake.run_dir.exists()
