"""A kdn-store that stops answering costs cache hits, nothing else
(docs/kvbus.md, "A store that does not answer"): while it is stopped
(SIGSTOP), every request still succeeds; once it runs again, it serves hits
again.
"""

import os
import signal
import time

import pytest

from deploy_util import Deployment, metric, parse_metrics


@pytest.fixture(scope="module")
def with_store(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-store"), tiny_model, "--store",
                   "--store-host-mib", 64)
    try:
        yield d
    finally:
        os.kill(d.pid("store"), signal.SIGCONT)  # down must be able to stop it
        d.down()


def prompt(i):
    # Over two 256-token chunks: each request looks chunks up in the store.
    return ("document %d: " % i) + "the cache is a delivery network. " * 20


def test_a_stopped_store_costs_hits_not_requests(with_store):
    d = with_store
    for i in range(3):
        d.completion(prompt(i), max_tokens=4, temperature=0)
    store = d.pid("store")
    os.kill(store, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # New prompts and repeated ones; d.completion asserts a 200 for each.
        for i in range(24):
            try:
                r = d.completion(prompt(i % 6), max_tokens=4, temperature=0)
            except AssertionError as e:
                raise AssertionError("request %d, %.1f s after SIGSTOP: %s\n%s" % (
                    i, time.monotonic() - started, e, d.log_tails(30))) from None
            assert r["choices"][0]["finish_reason"] == "length"
        elapsed = time.monotonic() - started
        s = parse_metrics(d.metrics())
        for w, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert metric(s, "kdn_worker_up", worker=w, role=role) == 1, (w, elapsed)
        # The misses it cost are counted.
        assert metric(s, "kdn_worker_store_unreachable_total", worker="prefill-0",
                      role="prefill") > 0
    finally:
        os.kill(store, signal.SIGCONT)
    # Back: requests still succeed, and a prompt seen before hits the cache.
    d.completion(prompt(100), max_tokens=4, temperature=0)
    r = d.completion(prompt(100), max_tokens=4, temperature=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r["usage"]
