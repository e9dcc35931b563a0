"""A decode worker dies mid-stream (docs/serving.md, "Routing"): the client
gets an error event instead of a hang, and the deployment keeps serving with
the other decode worker.

This one deployment serves the generated `small` model: on the tiny one a
1500-token stream is over in well under a second, before the test could kill
anything.
"""

import json
import os
import signal
import socket
import subprocess
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

from deploy_util import Deployment, binary, launch, metric, parse_metrics, wait_until

ERROR_WITHIN_S = 20.0
DECODE_WORKERS = ("decode-0", "decode-1")
# Requests sent after the kill. Their greedy continuations on the small model
# are valid UTF-8 (checked first), so that this test does not depend on how
# the deployment renders other bytes (test_api covers that on its own).
AFTER_KILL_PROMPTS = ("after the kill 0", "after the kill 3", "after the kill 4")


def continuation_bytes(model, prompt, max_tokens):
    r = subprocess.run([binary("kdn-generate"), "--model", str(model), "--prompt", prompt,
                        "--max-tokens", str(max_tokens), "--threads", "1"],
                       capture_output=True, timeout=120, check=True)
    return r.stdout[:-1]


@pytest.fixture(scope="module")
def deployment_1x2(small_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-1x2"), small_model, "--decode", 2)
    try:
        yield d
    finally:
        d.down()


def busy_decode_workers(d):
    """The decode workers up with a request (a dead one's last depth stays)."""
    s = parse_metrics(d.metrics())
    return [w for w in DECODE_WORKERS
            if metric(s, "kdn_worker_up", worker=w, role="decode") == 1
            and metric(s, "kdn_worker_queue_depth", worker=w, role="decode") >= 1]


def test_killing_a_decode_worker_mid_stream(deployment_1x2):
    d = deployment_1x2
    for prompt in AFTER_KILL_PROMPTS:
        out = continuation_bytes(d.model, prompt, 8)
        try:
            out.decode("utf-8")
        except UnicodeDecodeError:
            pytest.fail("precondition: %r continues with non-UTF-8 bytes %r on this model; "
                        "pick other AFTER_KILL_PROMPTS" % (prompt, out))
    # Reads time out after 25 s so that a hang fails the test instead of
    # holding it; no retries, which could hide the failure.
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0,
                           timeout=httpx.Timeout(25.0, connect=5.0))
    stream = client.completions.create(model=d.model_name, prompt="Once upon a time",
                                       max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    try:
        for _ in range(3):
            next(chunks)
        busy = wait_until(lambda: busy_decode_workers(d) or None, 5)
        assert busy and len(busy) == 1, (
            "kdn_worker_queue_depth{role=decode} should show one busy decode worker, got %s" % busy)
        victim = busy[0]
        survivor = next(w for w in DECODE_WORKERS if w != victim)
        os.kill(d.pid(victim), signal.SIGKILL)
        killed_at = time.monotonic()

        error, more = None, 0
        try:
            for _ in chunks:
                more += 1
                if time.monotonic() - killed_at > ERROR_WITHIN_S:
                    break
        except (openai.APITimeoutError, httpx.TimeoutException) as e:
            pytest.fail("the stream hung after %s was killed (%r)" % (victim, e))
        except openai.APIError as e:
            error = e
        elapsed = time.monotonic() - killed_at
    finally:
        stream.close()
        client.close()
    assert error is not None, (
        "no error event %.1f s after %s was killed (%d more chunks; the stream %s)"
        % (elapsed, victim, more, "ended cleanly" if elapsed < ERROR_WITHIN_S else "went on"))
    assert elapsed < ERROR_WITHIN_S, "the error came %.1f s after the kill" % elapsed
    assert str(error.message), error

    # The router marks the worker down; the deployment serves with the other.
    assert wait_until(lambda: metric(parse_metrics(d.metrics()), "kdn_worker_up", worker=victim,
                                     role="decode") == 0, 10), \
        "kdn_worker_up{worker=%s} is still 1 after it was killed" % victim
    assert metric(parse_metrics(d.metrics()), "kdn_worker_up", worker=survivor, role="decode") == 1
    for prompt in AFTER_KILL_PROMPTS:
        r = d.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                        timeout=30.0)
        assert r.status_code == 200, "%r after the kill -> %d %s\n%s" % (
            prompt, r.status_code, r.text[:300], d.log_tails())
        assert r.json()["usage"]["completion_tokens"] >= 1
    h = d.http.get("/health")
    assert h.status_code == 200, h.text

    # kdn-launch status reports the dead worker.
    st = launch("status", "--run-dir", d.run_dir)
    assert st.returncode == 1, st.stdout + st.stderr
    line = next(l for l in st.stdout.splitlines() if l.startswith(victim))
    assert "dead" in line.split(), line


def test_a_non_streaming_client_that_leaves_cancels_its_request(deployment_1x2):
    """A client that closes its connection while its non-streaming request
    generates (nothing is written to it until the end) frees the decode
    worker at once: the request is cancelled and counted as a 499, instead of
    generating all its tokens for nobody (1500 take the small model about
    half a minute)."""
    d = deployment_1x2
    before = metric(parse_metrics(d.metrics()), "kdn_requests_total",
                    route="/v1/completions", code="499")
    url = urlparse(d.url)
    body = json.dumps({"prompt": "The client leaves", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kdn\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        busy = wait_until(lambda: busy_decode_workers(d) or None, 10)
        assert busy, "no decode worker took the request"
    finally:
        sock.close()
    assert wait_until(lambda: not busy_decode_workers(d), 10), (
        "the decode worker still generates for a client that left\n" + d.log_tails())
    assert wait_until(lambda: metric(parse_metrics(d.metrics()), "kdn_requests_total",
                                     route="/v1/completions", code="499") == before + 1, 5)
