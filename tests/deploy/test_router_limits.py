"""kdn-router out of file descriptors (docs/serving.md, "Metrics"): the
accept that fails is tried again after a back-off (10 ms doubling to 1 s),
not at once in a loop that spins a core and floods the log, and the router
serves again once descriptors are free. The router's descriptor limit is
lowered while it runs (prlimit), and more connections are opened than it
may hold.
"""

import os
import resource
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from deploy_util import Deployment, metric, parse_metrics

HOLD_S = 2.5


@pytest.fixture(scope="module")
def deployment_fd(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-fd"), tiny_model, "--no-curve")
    try:
        yield d
    finally:
        d.down()


def test_accept_backs_off_when_out_of_descriptors(deployment_fd):
    d = deployment_fd
    pid = d.pid("router")
    url = urlparse(d.url)
    before = metric(parse_metrics(d.metrics()), "kdn_http_accept_errors_total")
    open_fds = len(os.listdir("/proc/%d/fd" % pid))
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    clients = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds + 16, old[1]))
        # The kernel completes the handshakes of the backlog; the router's
        # accept fails once it holds open_fds + 16 descriptors.
        for _ in range(64):
            clients.append(socket.create_connection((url.hostname, url.port), timeout=5))
        time.sleep(HOLD_S)
    finally:
        for c in clients:
            c.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    time.sleep(1.5)  # the last back-off, then the queued connections drain
    samples = parse_metrics(d.metrics())
    errors = metric(samples, "kdn_http_accept_errors_total") - before
    # Over 2.5 s a back-off of 10 ms doubling to 1 s allows about 9 tries;
    # retrying at once made millions.
    assert 1 <= errors <= 100, errors
    out = d.completion("Still serving", max_tokens=2)
    assert out["choices"][0]["text"] is not None
    log = open(next(p["log"] for p in d.info["processes"] if p["name"] == "router"),
               errors="replace").read()
    assert "trying again in" in log, log[-2000:]


def test_a_connection_over_the_cap_gets_503_and_the_router_serves_on(tiny_model, tmp_path):
    d = Deployment(tmp_path / "run", tiny_model, "--no-curve", "--max-connections", 4)
    url = urlparse(d.url)
    idle = []
    try:
        # Idle connections hold their places (the cap bounds what bodies
        # they may buffer); the ones past it are answered and closed.
        for _ in range(6):
            idle.append(socket.create_connection((url.hostname, url.port), timeout=5))
        time.sleep(0.3)
        r = httpx.get(d.url + "/health", timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "1"
        assert "--max-connections" in r.json()["error"]["message"]
        for c in idle:
            c.close()
        idle = []
        time.sleep(0.5)
        assert httpx.get(d.url + "/health", timeout=10).status_code == 200
        assert d.completion("Still serving", max_tokens=2)["choices"][0]["text"] is not None
    finally:
        for c in idle:
            c.close()
        d.down()
