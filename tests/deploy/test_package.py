"""The binary release (scripts/package.sh): unpacked in an empty folder, away
from the source tree and its build, kdn-launch serves the shipped model from
it with the release's own programs and libraries, and gpu-check.sh's quick
profile says there is no GPU and exits 0 on a machine without one.
"""

import json
import os
import subprocess
import sys

import httpx
import pytest

from deploy_util import BIN_DIR, REPO

GPU = subprocess.run("nvidia-smi -L", shell=True, capture_output=True, text=True).stdout.count("GPU") > 0


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "kdn.tgz"
    r = subprocess.run(["bash", str(REPO / "scripts" / "package.sh"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, KDN_BUILD_DIR=str(BIN_DIR.parent)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "package: " + str(out) in r.stdout, r.stdout
    root = tmp_path_factory.mktemp("unpacked")
    r = subprocess.run(["tar", "xzf", str(out), "-C", str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return root / "kdn"


def clean_env():
    """No hint of the source tree: no KDN_BIN_DIR, no library path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    env.pop("LD_LIBRARY_PATH", None)
    return env


def test_the_release_holds_its_programs_and_libraries(release):
    for name in ["kdn-router", "kdn-prefill", "kdn-decode", "kdn-store", "kdn-generate"]:
        assert os.access(release / "bin" / name, os.X_OK), name
    assert (release / "models" / "kdn-qa" / "config.json").is_file()
    assert "## Owed on a GPU" in (release / "docs" / "engine.md").read_text()
    # Every library a program needs resolves, none from the build tree.
    r = subprocess.run(["ldd", str(release / "bin" / "kdn-router")], capture_output=True, text=True,
                       env=clean_env())
    assert "not found" not in r.stdout, r.stdout
    assert str(BIN_DIR.parent) not in r.stdout, r.stdout
    assert str(release / "bin" / ".." / "lib") in r.stdout or str(release / "lib") in r.stdout, r.stdout


def test_the_release_python_package_loads_its_client_library(release):
    # From the release alone (no KDN_* variables, no build tree): the
    # package finds kdn/_lib/libkdn_client.so.2, whose libraries resolve in
    # lib/, and fingerprints the shipped model.
    code = ("import kdn; m = kdn.Model(%r); print(m.layers, len(m.fingerprint)); "
            "import kdn._native as n; print(n.lib._name)" % str(release / "models" / "kdn-qa"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(clean_env(), PYTHONPATH=str(release / "python")), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    layers, digits = r.stdout.split("\n")[0].split()
    assert int(layers) > 0 and digits == "32", r.stdout
    assert r.stdout.split("\n")[1] == str(release / "python" / "kdn" / "_lib" / "libkdn_client.so.2")
    r = subprocess.run(["ldd", str(release / "python" / "kdn" / "_lib" / "libkdn_client.so.2")],
                       capture_output=True, text=True, env=clean_env())
    assert "not found" not in r.stdout and str(BIN_DIR.parent) not in r.stdout, r.stdout


def test_kdn_launch_serves_the_shipped_model_from_the_release(release, tmp_path):
    launch = [sys.executable, str(release / "launch" / "kdn-launch")]
    run = tmp_path / "run"
    up = subprocess.run(launch + ["up", "--detach", "--port", "0", "--run-dir", str(run),
                                  "--threads", "1", "--ready-timeout", "60"],
                        capture_output=True, text=True, timeout=240, env=clean_env())
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        url = up.stdout.strip().splitlines()[-1].split()[-1]
        assert url.startswith("http://"), up.stdout
        # The programs that run are the release's.
        info = json.loads((run / "deployment.json").read_text())
        pids = [p["pid"] for p in info["processes"]]
        assert len(pids) >= 3, info
        for pid in pids:
            assert os.readlink("/proc/%d/exe" % pid).startswith(str(release / "bin")), pid
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"prompt": "Question: What color is the sky?\nAnswer:", "max_tokens": 4,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0, r.json()
    finally:
        subprocess.run(launch + ["down", "--run-dir", str(run)], capture_output=True, timeout=120,
                       env=clean_env())


@pytest.mark.skipif(GPU, reason="a GPU is present: the quick profile would run")
def test_gpu_check_quick_says_no_gpu_and_exits(release, tmp_path):
    r = subprocess.run(["bash", str(release / "scripts" / "gpu-check.sh"), "--profile", "quick"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=dict(clean_env(), OUT=str(tmp_path / "out")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU on this machine" in r.stdout, r.stdout
    assert "==" not in r.stdout, r.stdout  # no step ran


def test_gpu_check_refuses_an_unknown_profile(release):
    r = subprocess.run(["bash", str(release / "scripts" / "gpu-check.sh"), "--profile", "fast"],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 2 and "quick or full" in r.stderr, r.stdout + r.stderr
