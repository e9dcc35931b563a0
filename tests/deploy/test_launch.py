"""launch/kdn-launch itself: up, status, down and their errors."""

import json

from deploy_util import (Deployment, launch, metric, parse_metrics, pid_alive, repeat_cached,
                         wait_until)


def test_help_of_each_command():
    for args in ([], ["up"], ["down"], ["status"], ["demo"]):
        r = launch(*args, "--help")
        assert r.returncode == 0, r.stderr
        assert "usage: kdn-launch" in r.stdout
    r = launch("up", "--prefill", "0")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_up_with_missing_model_fails_clearly(tmp_path):
    missing = tmp_path / "no-such-model"
    run_dir = tmp_path / "run"
    r = launch("up", "--detach", "--port", 0, "--run-dir", run_dir, "--model", missing)
    assert r.returncode != 0
    assert str(missing) in r.stderr and "does not exist" in r.stderr, r.stderr
    assert not (run_dir / "deployment.json").exists()


def test_status_of_a_healthy_deployment(deployment):
    r = launch("status", "--run-dir", deployment.run_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in deployment.info["processes"]:
        line = next(l for l in r.stdout.splitlines() if l.split()[:1] == [p["name"]])
        assert str(p["pid"]) in line.split() and "alive" in line.split(), line
    assert '"status": "ok"' in r.stdout, r.stdout


def test_up_refuses_a_second_deployment_in_the_same_run_dir(deployment):
    r = launch("up", "--detach", "--port", 0, "--run-dir", deployment.run_dir,
               "--model", deployment.model)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "already up" in r.stderr, r.stderr
    assert all(pid_alive(pid) for pid in deployment.pids())
    assert deployment.http.get("/health").status_code == 200


def test_up_status_down_with_store(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    d = Deployment(run_dir, tiny_model, "--store", "--store-host-mib", 64, "--prefill", 2,
                   "--host-mib", 64)
    try:
        roles = sorted(p["role"] for p in d.info["processes"])
        assert roles == ["decode", "prefill", "prefill", "router", "store"], roles
        st = launch("status", "--run-dir", run_dir)
        assert st.returncode == 0, st.stdout + st.stderr
        text = "x" * 300 + "y" * 300
        first = d.completion(text, max_tokens=2, temperature=0)
        second = d.completion(text, max_tokens=2, temperature=0)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert (second["usage"]["prompt_tokens_details"]["cached_tokens"]
                == repeat_cached(601, 2)), second["usage"]
        pids = d.pids()
    finally:
        r = d.down()
    assert r.returncode == 0, r.stdout + r.stderr
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 2), \
        "still alive after down: %s" % [p for p in pids if pid_alive(p)]
    assert not (run_dir / "deployment.json").exists()
    st = launch("status", "--run-dir", run_dir)
    assert st.returncode == 1 and "nothing is running" in st.stdout, st.stdout
    again = launch("down", "--run-dir", run_dir)
    assert again.returncode == 0 and "nothing is running" in again.stdout, again.stdout


def test_deployment_json_names_every_process(deployment):
    info = json.loads((deployment.run_dir / "deployment.json").read_text())
    assert info["url"] == deployment.url
    assert isinstance(info["started"], int)
    names = [p["name"] for p in info["processes"]]
    assert names == ["prefill-0", "decode-0", "router"], names
    for p in info["processes"]:
        assert set(p) >= {"name", "role", "pid", "endpoint", "log", "cmd"}
        assert p["endpoint"].startswith("http://" if p["role"] == "router" else "tcp://")
        assert pid_alive(p["pid"])


def test_store_codec_codes_what_workers_store(tiny_model, tmp_path):
    """--store-codec q8: chunks reach kdn-store coded, about 4x smaller than
    the workers' f32 KV, and the answers stay the same when they are read back."""
    d = Deployment(tmp_path / "run", tiny_model, "--store", "--store-host-mib", 64,
                   "--store-codec", "q8")
    try:
        text = "a" * 300 + "b" * 300
        first = d.completion(text, max_tokens=2, temperature=0)
        second = d.completion(text, max_tokens=2, temperature=0)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        workers = [p["name"] for p in d.info["processes"] if p["role"] in ("prefill", "decode")]

        def encoded_chunks():
            s = parse_metrics(d.metrics())
            return sum(metric(s, "kdn_worker_kv_codec_chunks_total", worker=w,
                              role=w.split("-")[0], op="encode") for w in workers)
        # The router's figures come with the workers' next answers to its pings.
        assert wait_until(lambda: encoded_chunks() >= 2, 10), d.metrics()
        samples = parse_metrics(d.metrics())
        raw = sum(metric(samples, "kdn_worker_kv_codec_bytes_total", worker=w,
                         role=w.split("-")[0], form="raw") for w in workers)
        coded = sum(metric(samples, "kdn_worker_kv_codec_bytes_total", worker=w,
                           role=w.split("-")[0], form="encoded") for w in workers)
        assert coded < raw / 3, (coded, raw)
        errors = sum(metric(samples, "kdn_worker_kv_codec_decode_errors_total", worker=w,
                            role=w.split("-")[0]) for w in workers)
        assert errors == 0
    finally:
        d.down()
