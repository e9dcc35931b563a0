"""Admission by what a request needs now, and preemption into the KDN
(docs/serving.md, "Admission and preemption").

The load of issue 52, on the shipped models/kdn-qa: 64 concurrent streaming
requests, each a prompt of 1,024 tokens with max_tokens 1,000 and
ignore_eos, against one decode worker whose KV pool holds 4,096 blocks of 16
tokens (65,536 tokens: half of what the 64 need at their longest) and whose
batch takes all 64. Every request finishes, each stream equal to the same
request run alone (kdn-generate), the decode worker preempted and resumed
requests to get there, and at the end every KV block is free or held only by
the pool's resident index.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from deploy_util import REPO, Deployment, generate_ids, metric, settled_metrics

QA_MODEL = REPO / "models" / "kdn-qa"
REQUESTS = 64
PROMPT_TOKENS = 1024
MAX_TOKENS = 1000
BOS = 256  # kdn-qa's byte-level vocabulary: bytes, then BOS and EOS


def prompts():
    """64 prompts of kdn-qa's kind (documents, a question), each from a
    different place in its evaluation set, as 1,024 token ids."""
    rows = [json.loads(line) for line in (QA_MODEL / "eval.jsonl").read_text().splitlines()]
    out = []
    for i in range(REQUESTS):
        question = "\nQuestion: %s\nAnswer:" % rows[i]["question"]
        text = ""
        for r in rows[i:] + rows[:i]:
            for doc in r["documents"]:
                text += doc + " "
            if len(text) + len(question) >= PROMPT_TOKENS:
                break
        ids = list((text[:PROMPT_TOKENS - 1 - len(question)] + question).encode())
        out.append([BOS] + ids)
        assert len(out[-1]) == PROMPT_TOKENS
    return out


def stream(url, ids):
    """One streaming completion: its text and finish reason, or the failure."""
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = [], None
    with httpx.Client(base_url=url, timeout=httpx.Timeout(600.0)) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, "HTTP %d %s" % (r.status_code, r.read()[:300])
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None, "error event %s" % event["error"]
                choice = event["choices"][0]
                text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def test_an_overcommitted_burst_finishes_every_request_as_if_alone(tmp_path):
    d = Deployment(tmp_path / "run", QA_MODEL, "--max-batch", REQUESTS, "--disaggregation",
                   "always")
    try:
        status = d.http.get("/status.json").json()
        decode = next(w for w in status["workers"] if w["role"] == "decode")
        assert decode["total_kv_blocks"] == 4096, decode["total_kv_blocks"]
        load = prompts()
        with ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(lambda ids: stream(d.url, ids), load))
        failed = [(i, why) for i, (text, why) in enumerate(got) if text is None]
        assert not failed, "%d of %d failed: %s" % (len(failed), REQUESTS, failed[:3])
        assert [finish for _, finish in got] == ["length"] * REQUESTS

        after = settled_metrics(d)
        w = {"worker": "decode-0", "role": "decode"}
        preemptions = metric(after, "kdn_worker_preemptions_total", **w)
        by_load = metric(after, "kdn_worker_resumes_by_load_total", **w)
        by_recompute = metric(after, "kdn_worker_resumes_by_recompute_total", **w)
        assert preemptions > 0, "the load never ran the pool short"
        assert by_load + by_recompute == preemptions, (preemptions, by_load, by_recompute)
        assert metric(after, "kdn_worker_preempted_requests", **w) == 0
        # Every block is free or resident and held by no request.
        assert metric(after, "kdn_worker_free_kv_blocks", **w) == 4096

        with ThreadPoolExecutor(2) as pool:
            alone = list(pool.map(lambda ids: generate_ids(QA_MODEL, ids, MAX_TOKENS), load))
        for i, ((text, _), want) in enumerate(zip(got, alone)):
            assert text == want.decode("utf-8", errors="replace"), (
                "request %d differs from its run alone" % i)
    finally:
        d.down()
