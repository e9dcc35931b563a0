"""The decode worker that holds a conversation prefills its next turn itself
(docs/serving.md, "Two paths").

Each request's "disaggregation" field forces a path: "always" (a prefill
worker computes the prompt and moves its KV) or "never" (the decode worker
computes what it lacks). Both give kdn-generate's tokens on every turn; the
router's and the workers' counters say which path each took and what it
computed. With the router's default (auto), a chat's later turn, which the
decode worker holds but for its new tokens, is prefilled there.
"""

import os
import random
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from deploy_util import (Deployment, binary, generate_ids, metric, parse_metrics,
                         settled_metrics, wait_until)

ANSWER_TOKENS = 8
FIRST_TOKENS = 300
TURN_TOKENS = 40


def engine(model, ids, *flags):
    return generate_ids(model, ids, ANSWER_TOKENS, *flags)


def routed(samples, path):
    return metric(samples, "kdn_requests_routed_total", path=path)


def local_counters(samples):
    return (metric(samples, "kdn_worker_local_prefills_total", worker="decode-0", role="decode"),
            metric(samples, "kdn_worker_local_prefill_tokens_total", worker="decode-0",
                   role="decode"))


@pytest.mark.parametrize("path", ["never", "always"])
def test_a_conversation_gives_kdn_generates_tokens_on_either_path(store_deployment, path):
    d = store_deployment
    rng = random.Random(20261125 + len(path))
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    local = path == "never"
    for turn in range(1, 4):
        before = settled_metrics(d)
        r = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation=path)
        after = settled_metrics(d)
        want = engine(d.model, ids).decode("utf-8", errors="replace")
        assert r["choices"][0]["text"] == want, "turn %d (%s): text differs from kdn-generate's" % (
            turn, path)
        usage = r["usage"]
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == ANSWER_TOKENS
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert routed(after, "local") - routed(before, "local") == (1 if local else 0), turn
        assert routed(after, "disaggregated") - routed(before, "disaggregated") == (
            0 if local else 1), turn
        requests, tokens = (a - b for a, b in zip(local_counters(after), local_counters(before)))
        if local:
            # The decode worker computed what it did not hold, and only that.
            assert requests == 1 and tokens == len(ids) - cached, (turn, requests, tokens, cached)
            if turn > 1:
                # It kept the conversation: all but the last answer token and
                # the new message were attached.
                assert tokens == TURN_TOKENS + 1, (turn, tokens)
        else:
            assert requests == 0 and tokens == 0, turn
        answer = [int(t) for t in engine(d.model, ids, "--print-ids").split(b",")]
        ids = ids + answer + [rng.randrange(3, 256) for _ in range(TURN_TOKENS)]


def test_by_default_a_later_turn_is_prefilled_by_the_decode_worker_that_holds_it(
        store_deployment):
    d = store_deployment
    rng = random.Random(7)
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    first = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
    answer = [int(t) for t in engine(d.model, ids, "--print-ids").split(b",")]
    assert first["choices"][0]["text"] == engine(d.model, ids).decode("utf-8", errors="replace")
    ids = ids + answer + [rng.randrange(3, 256) for _ in range(TURN_TOKENS)]
    before = settled_metrics(d)
    r = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    after = settled_metrics(d)
    assert r["choices"][0]["text"] == engine(d.model, ids).decode("utf-8", errors="replace")
    assert routed(after, "local") - routed(before, "local") == 1
    requests, tokens = (a - b for a, b in zip(local_counters(after), local_counters(before)))
    assert (requests, tokens) == (1, TURN_TOKENS + 1)


def test_a_bad_disaggregation_field_is_refused(store_deployment):
    r = store_deployment.http.post("/v1/completions",
                                   json=dict(prompt="hi", max_tokens=2, disaggregation="sometimes"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "disaggregation"


def test_a_decode_worker_killed_mid_local_prefill_loses_nothing(small_model, tmp_path):
    """The request resumes on the other decode worker (on the prefill
    worker's path) and answers as if nothing happened."""
    d = Deployment(tmp_path / "run", small_model, "--decode", 2)
    try:
        # Long enough that the small model's prefill on one thread takes a
        # good part of a second.
        prompt = " ".join("word%d" % (i % 97) for i in range(250))
        want = subprocess.run([binary("kdn-generate"), "--model", str(small_model), "--prompt",
                               prompt, "--max-tokens", "4", "--threads", "1"],
                              capture_output=True, timeout=120, check=True).stdout[:-1]
        logs = {p["name"]: Path(p["log"]) for p in d.info["processes"]}
        sizes = {n: logs[n].stat().st_size for n in ("decode-0", "decode-1")}
        result = {}

        def send():
            result["r"] = d.http.post("/v1/completions", timeout=120.0, json=dict(
                prompt=prompt, max_tokens=4, temperature=0, disaggregation="never"))

        t = threading.Thread(target=send)
        t.start()

        def preparing():
            for name in sizes:
                with open(logs[name], "rb") as f:
                    f.seek(sizes[name])
                    if b"prepare:" in f.read():
                        return name
            return None

        victim = wait_until(preparing, 30)
        assert victim, d.log_tails()
        os.kill(d.pid(victim), signal.SIGKILL)
        t.join(120)
        assert not t.is_alive()
        r = result["r"]
        assert r.status_code == 200, r.text[:500]
        assert r.json()["choices"][0]["text"] == want.decode("utf-8", errors="replace")
        with open(logs[victim], "rb") as f:
            f.seek(sizes[victim])
            assert b"local prefill:" not in f.read(), "the kill came after the local prefill"
        s = parse_metrics(d.metrics())
        assert metric(s, "kdn_requests_resumed_total") == 1
        assert routed(s, "local") == 1 and routed(s, "disaggregated") == 1
    finally:
        d.down()
