"""A burst whose prefill queue outlasts the decode worker's prepare timeout
(docs/serving.md, "Reservations"): every request the router accepted
finishes, each stream equal to kdn-generate's answer, none with an error
after its first token.

16 cold prompts of 512 tokens on the small model (about half a second of
prefill each on one thread) queue at the one prefill worker for several
seconds, while the decode worker drops a prepared request its router has
not renewed for 1 s. Before reservations were renewed, every request whose
prefill waited past that second was computed and then refused at its
Start ("not prepared here (or expired)"), after its first token had been
streamed. The test checks that the queue did outlast the timeout (the last
first token came several timeouts after the burst), so it cannot pass by
the burst being quick.
"""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from deploy_util import Deployment, generate_ids

REQUESTS = 16
PROMPT_TOKENS = 512
ANSWER_TOKENS = 8
PREPARE_TIMEOUT_MS = 1000


def stream(url, ids):
    """One streaming completion: (text, finish reason, seconds to its first
    token, the error event or HTTP failure that ended it or None)."""
    body = {"prompt": ids, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "disaggregation": "always"}
    text, finish, first = [], None, None
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=httpx.Timeout(300.0)) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, None, None, "HTTP %d %s" % (r.status_code, r.read()[:300])
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "".join(text), finish, first, "error event %s after %d chunks" % (
                        event["error"], len(text))
                if first is None:
                    first = time.monotonic() - t0
                choice = event["choices"][0]
                text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish, first, None


def test_a_burst_queued_past_the_prepare_timeout_loses_no_request(small_model, tmp_path):
    rng = random.Random(20261206)
    # Distinct from the first token on: nothing is cached, every prompt is
    # computed whole by the one prefill worker.
    load = [[rng.randrange(3, 256) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    d = Deployment(tmp_path / "run", small_model, "--max-batch", REQUESTS,
                   "--decode-prepare-timeout-ms", PREPARE_TIMEOUT_MS)
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(lambda ids: stream(d.url, ids), load))
        failed = [(i, why) for i, (_, _, _, why) in enumerate(got) if why is not None]
        assert not failed, "%d of %d failed: %s" % (len(failed), REQUESTS, failed[:3])
        # The prefill queue did outlast the timeout: the last first tokens
        # came after their reservations had waited several timeouts.
        slowest = max(first for _, _, first, _ in got)
        assert slowest > 3 * PREPARE_TIMEOUT_MS / 1000, \
            "the burst's slowest first token came after %.2f s: it never waited past the " \
            "decode worker's prepare timeout (%d ms)" % (slowest, PREPARE_TIMEOUT_MS)
    finally:
        d.down()
    for i, (ids, (text, finish, _, _)) in enumerate(zip(load, got)):
        assert finish == "length", (i, finish)
        want = generate_ids(small_model, ids, ANSWER_TOKENS).decode("utf-8", errors="replace")
        assert text == want, "request %d differs from kdn-generate" % i
