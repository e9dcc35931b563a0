"""kdn-router's cap on the request-body bytes it buffers over all its
connections (--max-body-buffer-mib; docs/serving.md, "Limits"). Many clients
each send most of a large body and stall: without the cap each stalled body
stays in the router's memory (40 of 15 MB took it from 13 to 585 MiB); with
it, a body that would go past the cap is answered 503 with Retry-After
before any of it is read, the router's RSS stays under the cap plus a small
margin, and /health keeps answering.
"""

import socket
import time
from urllib.parse import urlparse

import httpx

from deploy_util import Deployment

CAP_MIB = 64
BODY = 16_000_000      # under the 16 MiB a body may be
SENT = 15_000_000      # what each client sends before it stalls
CLIENTS = 40
MARGIN_MIB = 48        # the router's own memory, buffers, parse pool


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS for %d" % pid)


def test_stalled_bodies_stay_under_the_cap_and_health_answers(tiny_model, tmp_path):
    d = Deployment(tmp_path / "run", tiny_model, "--no-curve", "--max-body-buffer-mib", CAP_MIB)
    url = urlparse(d.url)
    pid = d.pid("router")
    clients, refused = [], 0
    chunk = b"x" * (1 << 20)
    try:
        before = rss_mib(pid)
        for _ in range(CLIENTS):
            c = socket.create_connection((url.hostname, url.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % BODY)
            sent = 0
            try:
                while sent < SENT:
                    n = min(len(chunk), SENT - sent)
                    c.sendall(chunk[:n])
                    sent += n
            except OSError:
                pass  # refused: the router answered and closed
            clients.append(c)
        time.sleep(1.0)
        peak = rss_mib(pid)
        for c in clients:
            c.settimeout(0.5)
            try:
                head = c.recv(4096)
            except OSError:
                continue
            if head.startswith(b"HTTP/1.1 503"):
                refused += 1
                assert b"Retry-After: 1" in head or b"retry-after: 1" in head.lower(), head
                assert b"--max-body-buffer-mib" in head, head
        r = httpx.get(d.url + "/health", timeout=10)
        assert r.status_code == 200, r.text
        print("router RSS: %.0f MiB before, %.0f MiB with %d stalled bodies (%d refused), "
              "cap %d MiB" % (before, peak, CLIENTS, refused, CAP_MIB))
        assert refused >= CLIENTS - CAP_MIB * (1 << 20) // BODY, refused
        assert peak < before + CAP_MIB + MARGIN_MIB, (before, peak)
    finally:
        for c in clients:
            c.close()
    # The stalled bodies gone, the router serves as before.
    time.sleep(0.5)
    try:
        assert d.completion("Still serving", max_tokens=2)["choices"][0]["text"] is not None
    finally:
        d.down()
