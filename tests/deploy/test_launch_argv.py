"""The command line of every process, in both of kdn-launch's modes: for the
same flags, `kdn-launch up --dry-run` and the Slurm job script of `kdn-launch
slurm submit` start each process with the same argv (docs/launch.md).

No Slurm runs here: stand-ins for sbatch, srun, scontrol, squeue and scancel
(on PATH) take the job script, and the script itself runs under bash, where
the stand-in srun records the argv each step would run and prints the
endpoint line the script waits for ("tcp://NAME-ENDPOINT", the name
--dry-run gives an endpoint not yet known).
"""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from deploy_util import launch

FAKE_TOOLS = {
    "sbatch": 'echo 4242\n',
    "squeue": 'exit 0\n',
    "scancel": 'exit 0\n',
    "scontrol": r'''case "$1 $2" in
  "show hostnames") echo node0 ;;
  "show node") echo "NodeName=node0 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=node0" ;;
  *) echo "Invalid job id specified" >&2; exit 1 ;;
esac
''',
    # srun ... --job-name=NAME ... --output=FILE ... bash -c 'step_main "$@"' step_main PIDFILE SLOT CMD...
    "srun": r'''out= name=
while [ $# -gt 0 ]; do
  case "$1" in
    --output=*) out=${1#--output=} ;;
    --job-name=*) name=${1#--job-name=} ;;
    bash) break ;;
  esac
  shift
done
shift 6
printf '%s\0' "$@" > "$KDN_FAKE_SRUN_DIR/$name"
if [ "$name" = router ]; then echo "http://router-ENDPOINT" > "$out"; else echo "tcp://$name-ENDPOINT" > "$out"; fi
''',
}


def write_tools(folder, tools):
    """Each {name: bash body} of `tools` as an executable script in
    `folder` (made here), for PATH to find before the real ones."""
    folder.mkdir()
    for name, body in tools.items():
        path = folder / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return folder


@pytest.fixture
def fake_slurm(tmp_path):
    return write_tools(tmp_path / "fake-slurm", FAKE_TOOLS)


@pytest.fixture
def model_dir(tmp_path):
    """A model folder as the launcher checks it: config.json only."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def dry_run_argvs(run_dir, model, flags):
    """{name: argv} of `kdn-launch up --dry-run`."""
    r = launch("up", "--dry-run", "--run-dir", run_dir, "--model", model, *flags)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        name, cmd = line.split(": ", 1)
        out[name] = shlex.split(cmd)
    return out


def job_script_argvs(run_dir, model, flags, fake_slurm):
    """{name: argv} of the steps the job script of `kdn-launch slurm submit`
    starts, when it runs; endpoints written as --dry-run writes them."""
    env = dict(os.environ, PATH="%s:%s" % (fake_slurm, os.environ["PATH"]))
    r = launch("slurm", "submit", "--run-dir", run_dir, "--model", model, *flags, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4242", r.stdout
    steps = run_dir / "steps"
    steps.mkdir()
    env.update(KDN_FAKE_SRUN_DIR=str(steps), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node0")
    job = subprocess.run(["bash", str(run_dir / "kdn.sbatch")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "kdn: serving on http://router-ENDPOINT" in job.stdout, job.stdout + job.stderr
    out = {}
    for f in steps.iterdir():
        words = f.read_bytes().split(b"\0")[:-1]
        out[f.name] = [re.sub(r"tcp://([\w-]+-ENDPOINT)", r"\1", w.decode()) for w in words]
    return out


def argvs_of_both(tmp_path, model, flags, fake_slurm):
    # One run folder for both, so that the CURVE key paths are the same.
    run_dir = tmp_path / "run"
    slurm = job_script_argvs(run_dir, model, flags, fake_slurm)
    local = dry_run_argvs(run_dir, model, flags)
    assert sorted(local) == sorted(slurm)
    # The same words first (what reaches each process), then in the same order.
    for name in local:
        only_local = [w for w in local[name] if w not in slurm[name]]
        only_slurm = [w for w in slurm[name] if w not in local[name]]
        assert sorted(local[name]) == sorted(slurm[name]), \
            "%s: only in up --dry-run: %s; only in the job script: %s" % (name, only_local,
                                                                         only_slurm)
    for name in local:
        assert local[name] == slurm[name], "%s:\n  up --dry-run: %s\n  job script:   %s" % (
            name, shlex.join(local[name]), shlex.join(slurm[name]))
    return local


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_flag_reaches_each_process_the_same_way_in_both_modes(tmp_path, model_dir,
                                                                     fake_slurm):
    keys = tmp_path / "keys"
    keys.write_text("sk-test tenant-a\n")
    heads = tmp_path / "heads.json"
    heads.write_text('{"profiled_heads": [{"layer": 0, "head": 0}]}')
    flags = ["--prefill", 2, "--decode", 2, "--store", "--store-host-mib", 100,
             "--store-codec", "q4", "--host-mib", 64, "--chunk-tokens", 128,
             "--kv-transport", "tcp", "--max-batch", 7, "--decode-kv-tokens", 4096,
             "--max-queued", 5,
             "--max-connections", 9, "--max-body-buffer-mib", 32, "--no-resume",
             "--disaggregation", "never", "--local-prefill-max-tokens", 300,
             "--max-pinned-mib", 64, "--local-prefill-step-tokens", 24,
             "--decode-admission-reserve", 0.05,
             "--host", "127.0.0.1", "--port", 0, "--separator", "<doc> x",
             "--recompute-ratio", 0.25, "--api-keys", keys, "--threads", 1,
             "--emphasis-heads", heads, "--emphasis-strength", 1.5,
             "--log-level", "debug", "--ready-timeout", 30]
    argvs = argvs_of_both(tmp_path, model_dir, flags, fake_slurm)
    assert sorted(argvs) == ["decode-0", "decode-1", "prefill-0", "prefill-1", "router", "store"]
    for name in ("decode-0", "decode-1"):
        assert flag(argvs[name], "--max-batch") == "7", argvs[name]
        assert flag(argvs[name], "--local-prefill-step-tokens") == "24", argvs[name]
        assert flag(argvs[name], "--admission-reserve") == "0.05", argvs[name]
        assert flag(argvs[name], "--kv-tokens") == "4096", argvs[name]
    for name in ("prefill-0", "prefill-1"):
        assert "--kv-tokens" not in argvs[name], argvs[name]
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        argv = argvs[name]
        assert (flag(argv, "--host-mib"), flag(argv, "--chunk-tokens"), flag(argv, "--threads"),
                flag(argv, "--kv-transport"), flag(argv, "--store"),
                flag(argv, "--store-codec"), flag(argv, "--log-level")) == \
            ("64", "128", "1", "tcp", "store-ENDPOINT", "q4", "debug"), argv
    assert flag(argvs["store"], "--host-mib") == "100"
    router = argvs["router"]
    assert (flag(router, "--max-queued"), flag(router, "--max-connections"),
            flag(router, "--max-body-buffer-mib"), flag(router, "--separator"),
            flag(router, "--recompute-ratio"), flag(router, "--api-keys"),
            flag(router, "--decode")) == \
        ("5", "9", "32", "<doc> x", "0.25", str(keys.resolve()),
         "decode-0-ENDPOINT,decode-1-ENDPOINT")
    assert "--no-resume" in router
    assert (flag(router, "--disaggregation"), flag(router, "--local-prefill-max-tokens"),
            flag(router, "--max-pinned-mib")) == ("never", "300", "64"), router
    assert (flag(router, "--emphasis-heads"), flag(router, "--emphasis-strength")) == \
        (str(heads.resolve()), "1.5"), router


def test_flags_left_out_are_left_out_in_both_modes(tmp_path, model_dir, fake_slurm):
    argvs = argvs_of_both(tmp_path, model_dir, ["--host", "127.0.0.1", "--port", 0],
                          fake_slurm)
    for argv in argvs.values():
        for name in ("--max-batch", "--max-queued", "--max-connections",
                     "--max-body-buffer-mib", "--log-level", "--no-resume", "--separator",
                     "--disaggregation", "--local-prefill-max-tokens", "--max-pinned-mib",
                     "--local-prefill-step-tokens", "--admission-reserve", "--kv-tokens",
                     "--emphasis-heads", "--emphasis-strength"):
            assert name not in argv, argv


def test_a_flag_equal_to_the_default_is_passed_in_both_modes(tmp_path, model_dir, fake_slurm):
    argvs = argvs_of_both(tmp_path, model_dir,
                          ["--host", "127.0.0.1", "--port", 0, "--max-batch", 32,
                           "--max-queued", 1024, "--max-connections", 1024,
                           "--max-body-buffer-mib", 256], fake_slurm)
    assert flag(argvs["decode-0"], "--max-batch") == "32"
    assert flag(argvs["router"], "--max-queued") == "1024"


def test_lookups_from_events_reach_every_router_and_need_the_event_ports(tmp_path, model_dir):
    argvs = dry_run_argvs(tmp_path / "run", model_dir,
                          ["--routers", 2, "--kv-events-port", 30000, "--lookups-from-events"])
    assert "--lookups-from-events" in argvs["router"] and "--lookups-from-events" in \
        argvs["router-1"], argvs
    r = launch("up", "--dry-run", "--run-dir", tmp_path / "run2", "--model", model_dir,
               "--lookups-from-events")
    assert r.returncode != 0
    assert "--lookups-from-events needs --kv-events-port" in r.stderr, r.stderr
