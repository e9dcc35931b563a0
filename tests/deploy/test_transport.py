"""kvbus data planes in a deployment (docs/kvbus.md, "Transports" and
"Landing in place"): on one host the prefill worker writes KV straight into
the decode worker's KV blocks (its pool, a shared segment) unless told to
use tcp, where the decode worker's receiver puts it there; either way the
decode worker copies nothing at Start, /metrics counts each plane per
worker, and the answer does not depend on the plane. The device planes
(cuda_ipc, nccl) run here too, the host backend standing in for a device
and its loopback link for NCCL (the workers' test mode, KDN_DEVICE_OPS=host;
docs/kvbus.md, "Device planes")."""

import subprocess

import pytest

from deploy_util import Deployment, binary, metric, parse_metrics, wait_until

PROMPT = "The transport under test carries every layer of this prompt's KV " * 6


PLANES = ("tcp", "shm", "cuda_ipc", "nccl")


def planes(d):
    """{(role, transport): bytes} from the deployment's /metrics."""
    samples = parse_metrics(d.metrics())
    return {(role, t): metric(samples, "kdn_worker_kv_transport_bytes_total",
                              worker="%s-0" % role, role=role, transport=t)
            for role in ("prefill", "decode") for t in PLANES}


def wait_for_plane(d, used):
    """Waits until both sides' figures of the request are in /metrics (a
    worker's report reaches the router with its next answer to a ping, each
    worker's on its own) and what the prefill worker sent by `used` the
    decode worker received by it; asserts no other plane moved KV."""
    def both_sides():
        g = planes(d)
        return g if g[("decode", used)] > 0 and g[("prefill", used)] == g[("decode", used)] \
            else None
    got = wait_until(both_sides, timeout=30)
    assert got, planes(d)
    assert all(v == 0 for (_, t), v in got.items() if t != used), got
    return got


def assert_landed_in_place(d):
    """Every pushed slice landed in the request's own blocks: nothing was
    copied into them at Start."""
    wait_until(lambda: metric(parse_metrics(d.metrics()), "kdn_worker_kv_landed_slices_total",
                              worker="decode-0", role="decode") > 0, timeout=10)
    samples = parse_metrics(d.metrics())
    assert metric(samples, "kdn_worker_kv_start_copy_bytes_total", worker="decode-0",
                  role="decode") == 0
    assert metric(samples, "kdn_worker_kv_landed_bytes_total", worker="decode-0",
                  role="decode") > 0


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_kv_lands_in_place_by_the_plane_the_topology_or_the_flag_picks(tiny_model, tmp_path,
                                                                       transport):
    d = Deployment(tmp_path / "run", tiny_model, "--kv-transport", transport)
    try:
        health = d.http.get("/health").json()
        hosts = {w["host_id"] for w in health["workers"]}
        assert len(hosts) == 1 and "" not in hosts, health
        assert {w["kv_transport"] for w in health["workers"]} == {transport}, health
        shown = parse_metrics(d.metrics())
        for role in ("prefill", "decode"):
            assert metric(shown, "kdn_worker_kv_transport_info", worker="%s-0" % role, role=role,
                          transport=transport) == 1
        out = d.completion(PROMPT, max_tokens=8, temperature=0, disaggregation="always")
        used = "tcp" if transport == "tcp" else "shm"
        wait_for_plane(d, used)
        samples = parse_metrics(d.metrics())
        # A CPU prefill worker reads the slices it pushes where they lie in
        # its pool, unless it sends by tcp (where they become chunks anyway).
        sourced = metric(samples, "kdn_kv_slices_sourced_total")
        assert (sourced > 0) == (transport != "tcp"), sourced
        assert metric(samples, "kdn_worker_kv_transport_chunks_total", worker="decode-0",
                      role="decode", transport=used) > 0
        assert metric(samples, "kdn_worker_kv_transport_seconds_total", worker="prefill-0",
                      role="prefill", transport=used) > 0
        assert_landed_in_place(d)
        text = out["choices"][0]["text"]
    finally:
        d.down()
    # Same greedy text whichever plane carried the KV.
    d2 = Deployment(tmp_path / "run2", tiny_model, "--kv-transport",
                    "shm" if transport == "tcp" else "tcp")
    try:
        assert d2.completion(PROMPT, max_tokens=8, temperature=0,
                             disaggregation="always")["choices"][0]["text"] == text
    finally:
        d2.down()


@pytest.mark.parametrize("plane", ["cuda_ipc", "nccl"])
def test_a_device_plane_over_the_host_backend_serves_kdn_generates_text(tiny_model, tmp_path,
                                                                       monkeypatch, plane):
    """--kv-transport cuda_ipc or nccl in the test mode: the decode worker
    allocates its KV pool as a device region; by cuda_ipc the prefill worker
    opens it and writes each layer slice into the claimed blocks, by nccl it
    sends each slice over the link the decode worker joined, which receives
    it onto them; either way the decode worker verifies the slices there
    through the same backend."""
    monkeypatch.setenv("KDN_DEVICE_OPS", "host")
    d = Deployment(tmp_path / "run", tiny_model, "--kv-transport", plane)
    try:
        health = d.http.get("/health").json()
        assert {w["kv_transport"] for w in health["workers"]} == {plane}, health
        out = d.completion(PROMPT, max_tokens=8, temperature=0, disaggregation="always")
        wait_for_plane(d, plane)
        assert metric(parse_metrics(d.metrics()), "kdn_kv_slices_sourced_total") > 0
        assert_landed_in_place(d)
    finally:
        d.down()
    r = subprocess.run([binary("kdn-generate"), "--model", str(tiny_model), "--prompt", PROMPT,
                        "--max-tokens", "8", "--threads", "1"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert out["choices"][0]["text"] == r.stdout.decode("utf-8")[:-1]


@pytest.mark.parametrize("plane", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("worker", ["kdn-prefill", "kdn-decode"])
def test_a_cpu_worker_refuses_a_device_plane_outside_the_test_mode(tiny_model, monkeypatch,
                                                                   worker, plane):
    monkeypatch.delenv("KDN_DEVICE_OPS", raising=False)
    r = subprocess.run([binary(worker), "--model", str(tiny_model), "--kv-transport", plane],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--kv-transport cuda_ipc or nccl needs a GPU worker" in r.stderr + r.stdout, r
