"""A decode worker dies mid-stream (docs/serving.md, "A decode worker lost"):
the router resumes the request on another decode worker and the client's
stream goes on without an error, token for token what an uninterrupted run
gives, greedy or seeded; the deployment keeps serving with the workers left.

This one deployment serves the generated `small` model: on the tiny one a
long stream is over in well under a second, before the test could kill
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

DECODE_WORKERS = ("decode-0", "decode-1", "decode-2")
# Long enough that the kill lands mid-stream (the small model makes about 40
# tokens a second on one thread), short enough to keep the suite quick.
STREAM_TOKENS = 400
# Requests sent after the kills. Their greedy continuations on the small model
# are valid UTF-8 (checked first), so that this test does not depend on how
# the deployment renders other bytes (test_api covers that on its own).
AFTER_KILL_PROMPTS = ("after the kill 0", "after the kill 3", "after the kill 4")


def continuation_bytes(model, prompt, max_tokens):
    r = subprocess.run([binary("kdn-generate"), "--model", str(model), "--prompt", prompt,
                        "--max-tokens", str(max_tokens), "--threads", "1"],
                       capture_output=True, timeout=120, check=True)
    return r.stdout[:-1]


@pytest.fixture(scope="module")
def deployment_1x3(small_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-1x3"), small_model, "--decode", 3)
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


def live_decode_workers(d):
    s = parse_metrics(d.metrics())
    return [w for w in DECODE_WORKERS if metric(s, "kdn_worker_up", worker=w, role="decode") == 1]


# Greedy, then seeded sampling: the resumed request's draws continue its
# sampler's stream where the lost worker left it.
@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 0.9, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_a_stream_whose_decode_worker_is_killed_goes_on_unchanged(deployment_1x3, sampling):
    d = deployment_1x3
    assert len(live_decode_workers(d)) >= 2, "precondition: two decode workers up"
    body = dict(sampling, prompt="Once upon a time, %s" % sampling, max_tokens=STREAM_TOKENS)
    body["ignore_eos"] = True
    # The run nothing interrupts.
    r = d.http.post("/v1/completions", json=body, timeout=120.0)
    assert r.status_code == 200, r.text[:300]
    want = r.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == STREAM_TOKENS
    resumed_before = metric(parse_metrics(d.metrics()), "kdn_requests_resumed_total")

    # Reads time out after 25 s so that a hang fails the test instead of
    # holding it; no retries, which could hide the failure.
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0,
                           timeout=httpx.Timeout(25.0, connect=5.0))
    extra = {"ignore_eos": True}
    stream = client.completions.create(
        model=d.model_name, prompt=body["prompt"], max_tokens=STREAM_TOKENS, stream=True,
        temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0),
        seed=sampling.get("seed"), extra_body=extra, stream_options={"include_usage": True})
    got, usage, finish = "", None, None
    try:
        chunks = iter(stream)
        for _ in range(3):
            c = next(chunks)
            got += c.choices[0].text if c.choices else ""
        busy = wait_until(lambda: busy_decode_workers(d) or None, 5)
        assert busy and len(busy) == 1, (
            "kdn_worker_queue_depth{role=decode} should show one busy decode worker, got %s" % busy)
        victim = busy[0]
        os.kill(d.pid(victim), signal.SIGKILL)
        try:
            for c in chunks:
                if c.choices:
                    got += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
                if c.usage:
                    usage = c.usage
        except (openai.APITimeoutError, httpx.TimeoutException) as e:
            pytest.fail("the stream hung after %s was killed (%r)" % (victim, e))
        except openai.APIError as e:
            pytest.fail("the stream failed after %s was killed: %s\n%s"
                        % (victim, e, d.log_tails()))
    finally:
        stream.close()
        client.close()
    assert len(got) < len(want) or got == want  # (the message below shows where they part)
    assert got == want, "resumed text differs from the uninterrupted run at character %d" % next(
        (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == STREAM_TOKENS, usage
    s = parse_metrics(d.metrics())
    assert metric(s, "kdn_requests_resumed_total") == resumed_before + 1
    assert metric(s, "kdn_worker_up", worker=victim, role="decode") == 0


def test_the_deployment_serves_on_after_the_kills(deployment_1x3):
    d = deployment_1x3
    for prompt in AFTER_KILL_PROMPTS:
        out = continuation_bytes(d.model, prompt, 8)
        try:
            out.decode("utf-8")
        except UnicodeDecodeError:
            pytest.fail("precondition: %r continues with non-UTF-8 bytes %r on this model; "
                        "pick other AFTER_KILL_PROMPTS" % (prompt, out))
    dead = [w for w in DECODE_WORKERS if w not in live_decode_workers(d)]
    assert dead, "precondition: a decode worker was killed"
    for prompt in AFTER_KILL_PROMPTS:
        r = d.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                        timeout=30.0)
        assert r.status_code == 200, "%r after the kill -> %d %s\n%s" % (
            prompt, r.status_code, r.text[:300], d.log_tails())
        assert r.json()["usage"]["completion_tokens"] >= 1
    h = d.http.get("/health")
    assert h.status_code == 200, h.text

    # kdn-launch status reports the dead workers.
    st = launch("status", "--run-dir", d.run_dir)
    assert st.returncode == 1, st.stdout + st.stderr
    for victim in dead:
        line = next(l for l in st.stdout.splitlines() if l.startswith(victim))
        assert "dead" in line.split(), line


def test_without_resume_the_client_gets_an_error_at_once(small_model, tmp_path):
    """--no-resume: a lost decode worker's streams end with an error event,
    within seconds, instead of hanging."""
    d = Deployment(tmp_path / "run", small_model, "--decode", 2, "--no-resume")
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0,
                           timeout=httpx.Timeout(25.0, connect=5.0))
    try:
        stream = client.completions.create(model=d.model_name, prompt="Once upon a time",
                                           max_tokens=1500, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        busy = wait_until(lambda: [w for w in DECODE_WORKERS[:2] if w in busy_decode_workers(d)]
                          or None, 5)
        assert busy, "no decode worker took the request"
        os.kill(d.pid(busy[0]), signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert time.monotonic() - killed_at < 20
        assert "closed its connection" in str(e.value.message), e.value
        stream.close()
    finally:
        client.close()
        d.down()


def test_a_non_streaming_client_that_leaves_cancels_its_request(deployment_1x3):
    """A client that closes its connection while its non-streaming request
    generates (nothing is written to it until the end) frees the decode
    worker at once: the request is cancelled and counted as a 499, instead of
    generating all its tokens for nobody (1500 take the small model about
    half a minute)."""
    d = deployment_1x3
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
