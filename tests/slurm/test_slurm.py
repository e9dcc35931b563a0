"""`kdn-launch slurm` on a real Slurm (Debian's munge, slurmctld, slurmd),
started for these tests on this host by slurm_cluster.py with two emulated
nodes, kdn0 on 127.0.0.2 and kdn1 on 127.0.0.3, each with two stand-in GPUs
(docs/slurm.md).

The deployment serves models/kdn-qa; greedy answers are checked against
kdn-generate, requests go through the official openai client.
"""

import subprocess
import sys
from pathlib import Path

import openai
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "deploy"))

from deploy_util import REPO, pid_alive, wait_until  # noqa: E402
from deploy_util import launch as deploy_launch  # noqa: E402
from test_api import engine_text as api_engine_text  # noqa: E402
from slurm_cluster import Cluster, Unavailable  # noqa: E402

MODEL = REPO / "models" / "kdn-qa"
DOCS = ["Faisnar was born in Tekshu. Faisnar works as a potter. Faisnar is 24 years old.\n",
        "Soulgai was born in Tekshu. Soulgai works as a mason. Soulgai is 61 years old.\n",
        "Tekshu is a town. The mayor of Tekshu is Faisnar. Tekshu has 7310 people.\n"]
# Long enough (over one 256-token chunk) that a second request reuses KV.
PROMPT = "".join(DOCS) * 3 + "Question: Where was Soulgai born?\nAnswer:"
MAX_TOKENS = 12
GPUS_PER_NODE = 2  # stand-in devices (slurm_cluster.py): binding only, no CUDA
UNAVAILABLE = []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("%s is missing" % MODEL)
    try:
        c = Cluster(tmp_path_factory.mktemp("slurm"), nodes=2, gpus=GPUS_PER_NODE).start()
    except Unavailable as e:
        UNAVAILABLE.append(str(e))
        pytest.skip("no Slurm cluster could start here: %s" % e)
    try:
        yield c
    finally:
        c.stop()


def launch(cluster, *args, timeout=240):
    return deploy_launch("slurm", *args, timeout=timeout, env=cluster.env)


def engine_text(prompt, max_tokens):
    return api_engine_text(MODEL, prompt, max_tokens)


class Job:
    """A submitted deployment: job id, run dir, URL; down() in teardown."""

    def __init__(self, cluster, run_dir, *flags):
        self.cluster = cluster
        self.run_dir = Path(run_dir)
        r = launch(cluster, "submit", "--run-dir", run_dir, "--model", MODEL, "--threads", 1,
                   "--wait", "--ready-timeout", 120, *flags)
        lines = r.stdout.strip().splitlines()
        self.job_id = lines[0] if lines and lines[0].isdigit() else None
        assert r.returncode == 0, r.stdout + r.stderr + self.job_log()
        assert lines[-1].startswith("kdn: serving on http://"), r.stdout
        self.url = lines[-1].split()[-1]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                                    timeout=60.0)

    def job_log(self):
        try:
            return "\njob.out:\n" + (self.run_dir / "logs" / "job.out").read_text()
        except OSError:
            return ""

    def pids(self):
        out = {}
        for f in (self.run_dir / "pids").iterdir():
            node, pid = f.read_text().split()
            out[f.name] = (node, int(pid))
        return out

    def health(self):
        import httpx
        return httpx.get(self.url + "/health", timeout=5).json()

    def status(self):
        return launch(self.cluster, "status", self.job_id)

    def down(self):
        if self.job_id is None:
            return
        pids = self.pids()
        r = launch(self.cluster, "down", self.job_id)
        self.job_id = None
        return r, pids


def job_state(cluster, job_id):
    r = subprocess.run(["scontrol", "show", "job", "--oneliner", str(job_id)],
                       capture_output=True, text=True, env=cluster.env)
    for field in r.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "GONE"


def completion(job, prompt=PROMPT):
    return job.client.completions.create(model="kdn-qa", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0)


def check_down(job):
    r, pids = job.down()
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[-1]
    assert job_state(job.cluster, job_id) not in ("RUNNING", "COMPLETING", "PENDING")
    left = [name for name, (_, pid) in pids.items() if pid_alive(pid)]
    assert not left, "still running after down: %s" % left
    return r


def test_one_node_serves_caches_survives_a_dead_worker_and_stops(cluster, tmp_path):
    job = Job(cluster, tmp_path / "run", "--prefill", 2, "--decode", 1, "--store")
    try:
        want = engine_text(PROMPT, MAX_TOKENS)
        first = completion(job)
        assert first.choices[0].text == want
        second = completion(job)
        assert second.choices[0].text == want
        assert second.usage.prompt_tokens_details.cached_tokens >= 256, second.usage

        st = job.status()
        assert st.returncode == 0, st.stdout + st.stderr
        rows = {line.split()[0]: line.split() for line in st.stdout.splitlines()[2:]
                if line.split() and line.split()[0] in ("prefill-0", "prefill-1", "decode-0",
                                                         "router")}
        assert sorted(rows) == ["decode-0", "prefill-0", "prefill-1", "router"], st.stdout
        assert "store" in st.stdout, st.stdout
        pids = job.pids()
        for name, row in rows.items():
            assert row[2] == "kdn0" and int(row[3]) == pids[name][1], st.stdout
            assert row[4] == "up" and row[5] == "ok", st.stdout

        # One worker step dies: status says so, the router stops using it,
        # and requests go on through the other prefill worker.
        steps = subprocess.run(["squeue", "--steps", "--noheader", "--jobs", job.job_id,
                                "--format", "%j %i"], capture_output=True, text=True,
                               env=cluster.env).stdout.split()
        step = steps[steps.index("prefill-1") + 1]
        subprocess.run(["scancel", "--signal=KILL", step], check=True, env=cluster.env)
        assert wait_until(lambda: not pid_alive(pids["prefill-1"][1]), 20)
        assert wait_until(lambda: not next(w["up"] for w in job.health()["workers"]
                                           if w["name"] == "prefill-1"), 20), job.health()
        st = job.status()
        assert st.returncode == 1, st.stdout
        row = next(line.split() for line in st.stdout.splitlines()
                   if line.startswith("prefill-1"))
        assert row[4] == "ended" and row[5] == "down", st.stdout
        for _ in range(3):
            assert completion(job).choices[0].text == want
    finally:
        if job.job_id:
            check_down(job)


def test_two_nodes_place_workers_apart_and_move_kv_over_tcp(cluster, tmp_path):
    job = Job(cluster, tmp_path / "run", "--nodes", 2, "--prefill", 1, "--decode", 1, "--store",
              "--max-queued", 64, "--no-resume")
    try:
        script = (job.run_dir / "kdn.sbatch").read_text()
        assert "#SBATCH --nodes=2" in script
        # The router flags of `kdn-launch up` reach the job's router.
        router_line = next(l for l in script.splitlines() if l.startswith("start router"))
        assert "--max-queued 64" in router_line and "--no-resume" in router_line, router_line
        pids = job.pids()
        assert pids["router"][0] == "kdn0" and pids["store"][0] == "kdn0"
        assert pids["prefill-0"][0] == "kdn0" and pids["decode-0"][0] == "kdn1", pids
        # Each role listens on its node's address.
        endpoint = {n: (job.run_dir / "logs" / (n + ".out")).read_text().split("\n")[0]
                    for n in pids}
        assert endpoint["prefill-0"].startswith("tcp://127.0.0.2:"), endpoint
        assert endpoint["decode-0"].startswith("tcp://127.0.0.3:"), endpoint
        assert endpoint["store"].startswith("tcp://127.0.0.2:"), endpoint
        assert job.url.startswith("http://127.0.0.2:"), job.url
        hosts = {w["name"]: w["host_id"] for w in job.health()["workers"]}
        assert hosts["prefill-0"] != hosts["decode-0"], hosts

        want = engine_text(PROMPT, MAX_TOKENS)
        assert completion(job).choices[0].text == want
        again = completion(job)
        assert again.choices[0].text == want
        assert again.usage.prompt_tokens_details.cached_tokens >= 256, again.usage

        # The KV crossed "hosts": kvbus chose tcp, not shared memory. (The
        # router's /metrics shows the workers' counters as of its last ping.)
        def counts():
            import httpx
            out = {}
            for line in httpx.get(job.url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("kdn_worker_kv_transport_chunks_total{") and \
                        'role="prefill"' in line:
                    out[line.split('transport="')[1].split('"')[0]] = float(line.split()[-1])
            return out
        assert wait_until(lambda: counts().get("tcp", 0) > 0, 10), counts()
        assert counts().get("shm") == 0, counts()
    finally:
        if job.job_id:
            check_down(job)


def test_submit_refuses_contradictions_before_sbatch(cluster, tmp_path):
    before = subprocess.run(["squeue", "--noheader", "--format", "%i"], capture_output=True,
                            text=True, env=cluster.env).stdout
    cases = [(["--nodes", 3], "more nodes than there are workers"),
             (["--nodes", 2, "--kv-transport", "shm"], "cannot reach across nodes"),
             (["--sbatch-arg=--time=5"], "kdn-launch's own flag"),
             (["--sbatch-arg", "qos"], "not an sbatch option"),
             (["--gpu-type", "h100"], "needs --gpus-per-worker")]
    for flags, words in cases:
        r = launch(cluster, "submit", "--run-dir", tmp_path / "run", "--model", MODEL, *flags)
        assert r.returncode == 1 and words in r.stderr, (flags, r.stdout, r.stderr)
        assert not (tmp_path / "run" / "kdn.sbatch").exists()
    after = subprocess.run(["squeue", "--noheader", "--format", "%i"], capture_output=True,
                           text=True, env=cluster.env).stdout
    assert before == after


def test_slurm_refusals_reach_the_user(cluster, tmp_path):
    # No such partition; more GPUs than a node has (2 workers x 2 > 2).
    for flags, words in [(["--partition", "nosuch"], "Invalid partition"),
                         (["--gpus-per-worker", 2], "Requested node configuration is not "
                                                    "available")]:
        r = launch(cluster, "submit", "--run-dir", tmp_path / "run", "--model", MODEL,
                   "--wait", "--ready-timeout", 30, *flags, timeout=60)
        assert r.returncode == 1, (flags, r.stdout, r.stderr)
        assert "sbatch" in r.stderr and words in r.stderr, (flags, r.stderr)
        assert r.stdout == "", r.stdout  # no job id: nothing was queued


def environ(pid):
    with open("/proc/%d/environ" % pid, "rb") as f:
        return dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if b"=" in v)


def test_each_worker_gets_gpus_of_its_own(cluster, tmp_path):
    job = Job(cluster, tmp_path / "run", "--prefill", 1, "--decode", 1, "--store",
              "--gpus-per-worker", 1)
    try:
        assert "#SBATCH --gres=gpu:2" in (job.run_dir / "kdn.sbatch").read_text()
        seen = {n: environ(pid).get("CUDA_VISIBLE_DEVICES") for n, (_, pid) in job.pids().items()}
        assert sorted([seen["prefill-0"], seen["decode-0"]]) == ["0", "1"], seen
        assert seen["router"] == "" and seen["store"] == "", seen
        assert completion(job).choices[0].text == engine_text(PROMPT, MAX_TOKENS)
    finally:
        if job.job_id:
            check_down(job)


def test_status_and_down_of_an_unknown_job_say_so(cluster, tmp_path):
    for cmd in ("status", "down"):
        r = launch(cluster, cmd, "999999")
        assert r.returncode == 1 and "no longer knows job 999999" in r.stderr, r.stderr


def test_a_worker_that_cannot_start_fails_the_job_with_its_log(cluster, tmp_path):
    model = tmp_path / "no-weights"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((MODEL / name).read_bytes())
    r = launch(cluster, "submit", "--run-dir", tmp_path / "run", "--model", model, "--wait",
               "--ready-timeout", 60, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    assert "job %s ended (FAILED" % job_id in r.stderr, r.stderr
    assert "ended before it printed its endpoint" in r.stderr, r.stderr
    assert "model.safetensors" in r.stderr, r.stderr  # the worker's own words
    assert job_state(cluster, job_id) == "FAILED"
