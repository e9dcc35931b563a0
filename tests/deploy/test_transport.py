"""kvbus data planes in a deployment (docs/kvbus.md, "Transports" and
"Landing in place"): on one host the prefill worker writes KV straight into
the decode worker's KV blocks (its pool, a shared segment) unless told to
use tcp, where the decode worker's receiver puts it there; either way the
decode worker copies nothing at Start, /metrics counts each plane per
worker, and the answer does not depend on the plane."""

import pytest

from deploy_util import Deployment, metric, parse_metrics, wait_until

PROMPT = "The transport under test carries every layer of this prompt's KV " * 6


def planes(d):
    """{(role, transport): bytes} from the deployment's /metrics."""
    samples = parse_metrics(d.metrics())
    return {(role, t): metric(samples, "kdn_worker_kv_transport_bytes_total",
                              worker="%s-0" % role, role=role, transport=t)
            for role in ("prefill", "decode") for t in ("tcp", "shm")}


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_kv_lands_in_place_by_the_plane_the_topology_or_the_flag_picks(tiny_model, tmp_path,
                                                                       transport):
    d = Deployment(tmp_path / "run", tiny_model, "--kv-transport", transport)
    try:
        health = d.http.get("/health").json()
        hosts = {w["host_id"] for w in health["workers"]}
        assert len(hosts) == 1 and "" not in hosts, health
        assert {w["kv_transport"] for w in health["workers"]} == {transport}, health
        out = d.completion(PROMPT, max_tokens=8, temperature=0, disaggregation="always")
        used = "tcp" if transport == "tcp" else "shm"
        other = "tcp" if used == "shm" else "shm"
        # Workers' figures reach the router with their next answer to its ping,
        # each worker's on its own (a report may be older than the request's
        # end): wait until both sides' figures of this request are there.
        # What the prefill worker sent by a plane, the decode worker received
        # by it.
        def both_sides():
            g = planes(d)
            return g if g[("decode", used)] > 0 and g[("prefill", used)] == g[("decode", used)] \
                else None
        got = wait_until(both_sides, timeout=30)
        assert got, planes(d)
        assert got[("prefill", other)] == 0 and got[("decode", other)] == 0, got
        samples = parse_metrics(d.metrics())
        assert metric(samples, "kdn_worker_kv_transport_chunks_total", worker="decode-0",
                      role="decode", transport=used) > 0
        assert metric(samples, "kdn_worker_kv_transport_seconds_total", worker="prefill-0",
                      role="prefill", transport=used) > 0
        # Every pushed slice landed in the request's own blocks: nothing was
        # copied into them at Start.
        wait_until(lambda: metric(parse_metrics(d.metrics()), "kdn_worker_kv_landed_slices_total",
                                  worker="decode-0", role="decode") > 0, timeout=10)
        samples = parse_metrics(d.metrics())
        assert metric(samples, "kdn_worker_kv_start_copy_bytes_total", worker="decode-0",
                      role="decode") == 0
        assert metric(samples, "kdn_worker_kv_landed_bytes_total", worker="decode-0",
                      role="decode") > 0
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
