"""Admission (docs/serving.md, "Admission"): requests beyond the decode
workers' room (KV for prompt + max_tokens, a place in the batch) wait at the
router, in arrival order and before any prefill is spent on them; past
--max-queued they get 429. /metrics shows the queue's depth and waits.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deploy_util import Deployment, metric, parse_metrics


def post_all(d, n, max_tokens):
    body = lambda i: {"prompt": "request %d: tell me about caches" % i,  # noqa: E731
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=d.url, timeout=120) as c, ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: c.post("/v1/completions", json=body(i)), range(n)))


@pytest.fixture(scope="module")
def batch_of_two(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-batch2"), tiny_model, "--max-batch", 2)
    try:
        yield d
    finally:
        d.down()


def test_requests_past_the_batch_wait_and_all_succeed(batch_of_two):
    d = batch_of_two
    # Eight times the batch, each long enough to overlap the others.
    replies = post_all(d, 16, 400)
    assert [r.status_code for r in replies] == [200] * 16, [r.text[:200] for r in replies]
    for r in replies:
        assert r.json()["usage"]["completion_tokens"] == 400
    s = parse_metrics(d.metrics())
    assert metric(s, "kdn_queue_wait_seconds_count") > 0
    assert metric(s, "kdn_queue_depth") == 0


def test_past_max_queued_a_request_gets_429(tiny_model, tmp_path):
    """A long request decoding (1,900 tokens, seen streaming before the
    others are sent, so that they arrive while it holds the only place in the
    batch): of seven more, one waits and the rest are refused with 429."""
    d = Deployment(tmp_path / "run", tiny_model, "--max-batch", 1, "--max-queued", 1)
    try:
        first = {"prompt": "request 0: tell me about caches", "max_tokens": 1900,
                 "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=d.url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=first) as a:
                assert a.status_code == 200, a.read()
                lines = a.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # it is decoding
                replies = post_all(d, 7, 8)
                done = any(line == "data: [DONE]" for line in lines)
        codes = sorted(r.status_code for r in replies)
        assert set(codes) <= {200, 429}, [r.text[:200] for r in replies]
        assert done, "the long request's stream ended early"
        assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
        refused = next(r for r in replies if r.status_code == 429)
        assert "--max-queued" in refused.json()["error"]["message"]
    finally:
        d.down()
